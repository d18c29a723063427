"""Readable problem names from op_name metadata (autotuner/hlo/names.py)."""

from __future__ import annotations

import pytest

from autotuner.hlo.names import argument_scopes, dot_label, problem_names, short_name


@pytest.mark.parametrize(("op_name", "name"), [
    # keras-hub: one scope per layer, the transformation around the outermost one
    ("jit(step)/transpose(jvp(llama_backbone))/transformer_layer_0/self_attention/query/bqm,muh->bquh/dot_general",
     "grad/self_attention/query"),
    ("jit(step)/jvp(llama_backbone)/transformer_layer_1/feedforward_gate_dense/dot_general",
     "llama_backbone/feedforward_gate_dense"),
    # keras-hub Gemma: the layer that runs the dot is `ffw_gating_2`, a name of its own beside
    # `ffw_gating`, not an index; `decoder_block_1` above it is one
    ("jit(logits)/gemma_backbone/decoder_block_1/ffw_gating_2/btd,df->btf/dot_general",
     "gemma_backbone/ffw_gating_2"),
    ("jit(step)/transpose(jvp(gemma_backbone))/decoder_block_0/ffw_gating/btd,df->btf/dot_general",
     "grad/gemma_backbone/ffw_gating"),
    # Flax linen's automatic names: every scope is an index but the layer that runs the dot
    ("jit(apply)/Encoder_0/MlpBlock_3/Dense_1/dot_general", "Dense_1"),
    # jax.named_scope("attention/qkv"): one scope holding a slash, wrapped whole by jvp/transpose
    ("jit(step)/transpose(jvp(attention/qkv))/bsd,dthk->bsthk/dot_general", "grad/attention/qkv"),
    ("jit(step)/jvp(mlp/up)/dot_general", "mlp/up"),
    ("jit(fwd)/mlp/down/dot_general", "mlp/down"),
    # penzai names its sublayers by position only: the last two indices
    ("jit(step)/jvp(1)/0/1/1/0/vmap(vmap(vmap()))/dot_general", "1/0"),
    ("jit(f)/dot_general", "dot"),
    ("jit(run)/jit(forward)/bsd,df->bsf/dot_general", "bsd,df->bsf"),
    # no named scope: the einsum itself; the pass's own scope is not part of the name
    ("jit(step)/jvp(bsd,df->bsf)/dot_general", "bsd,df->bsf"),
    ("jit(step)/transpose(jvp(bsd,df->bsf))/__overlap3_1_0__/dot_general", "grad/bsd,df->bsf"),
    # a scanned layer's loop body (Flax's nnx.scan calls it: closed_call) names no layer; its
    # scopes do where it has them
    ("jit(step)/jvp()/while/body/closed_call/dot_general", "dot"),
    ("jit(step)/transpose(jvp(llama_backbone))/while/body/decoder_layer/mlp/up/dot_general", "grad/mlp/up"),
])
def test_short_name(op_name: str, name: str) -> None:
    assert short_name(op_name) == name


def test_problem_names_join_distinct_dots_and_number_repeats() -> None:
    q = "jit(f)/attn/query/dot_general"
    k = "jit(f)/attn/key/dot_general"
    assert problem_names([[q, k, q], [q], [q]]) == ["attn/query+attn/key", "attn/query", "attn/query#2"]


@pytest.mark.parametrize(("op_name", "scopes"), [
    # Flax NNX's state as a jit argument, as XLA prints it (quotes escaped): the Variable's `.value`
    # and the kernel are the parameter's leaf, `['value']` is the attention's value projection
    (r"params[\'blocks\'][0][\'attn\'][\'value\'][\'kernel\'].value", ["blocks", "0", "attn", "value"]),
    ("params['head']['kernel'].value", ["head"]),
    ("params['value']", ["value"]),
    # an Equinox module's attributes; a bare argument is its own name
    ("model.layers[3].mlp.up.weight", ["layers", "3", "mlp", "up"]),
    ("w_up", ["w_up"]),
    # a name stack, or nothing, is not an argument
    ("jit(f)/mlp/up/dot_general", []),
    ("", []),
])
def test_argument_scopes(op_name: str, scopes: list[str]) -> None:
    assert argument_scopes(op_name) == scopes


def test_a_dot_the_name_stack_does_not_name_is_named_by_the_argument_it_multiplies() -> None:
    flax = r"params[\'blocks\'][1][\'attn\'][\'query\'][\'kernel\'].value"
    assert short_name(dot_label("jit(step)/jvp()/dot_general", ["", flax])) == "attn/query"
    assert short_name(dot_label("jit(step)/transpose(jvp())/dot_general", [flax, ""])) == "grad/attn/query"
    # the deeper path is the model's weight, not the input; on a tie the later operand (x @ w)
    assert short_name(dot_label("jit(f)/dot_general", ["model.mlp.up.weight", "x"])) == "mlp/up"
    assert short_name(dot_label("jit(f)/dot_general", ["x", "w"])) == "w"
    # Equinox scopes each call by its module's class: those name no layer, the weight's path does
    eqx = "params.blocks[0].attn.query_proj.weight"
    assert short_name(dot_label("jit(step)/jvp(vmap(eqx.nn.MultiheadAttention))/vmap(eqx.nn.Linear)/dot_general",
                                [eqx, ""])) == "attn/query_proj"
    assert short_name(dot_label("jit(step)/transpose(jvp(vmap(vmap(eqx.nn.Linear))))/dot_general",
                                ["", "", "params.blocks[1].up.weight", ""])) == "grad/blocks/up"
    # a named scope (penzai's positions too) or an einsum still names it; no argument leaves `dot`
    assert short_name(dot_label("jit(step)/jvp(1)/0/1/1/0/vmap(vmap(vmap()))/dot_general", [flax])) == "1/0"
    assert short_name(dot_label("jit(f)/mlp/down/dot_general", ["", flax])) == "mlp/down"
    assert short_name(dot_label("jit(f)/bsd,df->bsf/dot_general", ["", flax])) == "bsd,df->bsf"
    assert short_name(dot_label("jit(f)/dot_general", ["", ""])) == "dot"


def test_the_partitioned_module_says_which_argument_each_dot_multiplies() -> None:
    """JAX writes each argument's path into its parameter's op_name and the partitioner keeps it;
    a weight's gradient (two computed operands) takes its forward dot's argument by source line."""
    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from autotuner.hlo.compile import partitioned_hlo
    from autotuner.hlo.text import parse_hlo

    mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])

    def loss(params, x):
        h = jnp.tanh(x @ params["mlp"]["up"].T)
        return jnp.sum(h @ params["mlp"]["down"])

    params = {"mlp": {"up": jnp.ones((8, 4)), "down": jnp.ones((8, 4))}}
    x = jax.device_put(jnp.ones((4, 4)), NamedSharding(mesh, P("data", None)))
    _, post, parts = partitioned_hlo(jax.jit(jax.value_and_grad(loss)), params, x)
    assert parts == 2
    mod = parse_hlo(post)
    names = {short_name(dot_label(d.op_name, mod.arguments(d))) for d in mod.instrs.values() if d.opcode == "dot"}
    assert names == {"mlp/up", "mlp/down", "grad/mlp/up", "grad/mlp/down"}


@pytest.mark.parametrize("remat", [False, True])
def test_a_scanned_dot_is_named_by_the_stacked_argument_its_loop_slices(remat: bool) -> None:
    """A scan over stacked weights multiplies one slice per iteration of the argument the loop
    carries unchanged: its path names the dot, and its input gradient's; under remat the
    recomputed dot's too, whose inputs pass an optimization barrier. Two weights multiplied on one
    line (one stack frame) keep their own names. A value the loop changes (the carry, here
    initialized from the argument `x`) is not that argument after the first iteration: it names
    nothing."""
    from collections import Counter

    import jax
    import jax.numpy as jnp
    from jax.sharding import AxisType, NamedSharding
    from jax.sharding import PartitionSpec as P

    from autotuner.hlo.compile import partitioned_hlo
    from autotuner.hlo.text import parse_hlo

    mesh = jax.make_mesh((2,), ("data",), axis_types=(AxisType.Auto,), devices=jax.devices()[:2])

    def loss(params, x):
        def layer(h, w):
            g = h @ h.T   # h: carried, changed each iteration
            for k in ("up", "down"):   # one source line, so one stack frame, for both weights' dots
                h = jnp.tanh(h @ w[k])
            return h + g, None
        h, _ = jax.lax.scan(jax.checkpoint(layer) if remat else layer, x, params["mlp"])
        return jnp.sum(h)

    params = {"mlp": {"up": jnp.ones((3, 4, 4)), "down": jnp.ones((3, 4, 4))}}
    x = jax.device_put(jnp.ones((4, 4)), NamedSharding(mesh, P("data", None)))
    _, post, parts = partitioned_hlo(jax.jit(jax.value_and_grad(loss)), params, x)
    assert parts == 2
    mod = parse_hlo(post)
    names = Counter(short_name(dot_label(d.op_name, mod.arguments(d))) for d in mod.instrs.values() if d.opcode == "dot")
    assert names["mlp/up"] == names["mlp/down"] == 1, names
    # down's input gradient (and, under remat, its recomputation); its weight gradient multiplies
    # no argument and takes the line's first dot's name (up's)
    assert names["grad/mlp/down"] == (2 if remat else 1), names
    assert set(names) == {"mlp/up", "mlp/down", "grad/mlp/up", "grad/mlp/down", "dot", "grad/dot"}, names   # not `x`
