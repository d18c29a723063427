// Draws every figure whose JSON sits in a <script type="application/json"> (see _plot.html),
// opens a problem when a shape-map point is clicked, and wires the copy button.
// Served by the dashboard itself; no other host is ever contacted.
(function () {
  "use strict";

  function draw(el) {
    var data = document.getElementById(el.getAttribute("data-figure"));
    if (!data || typeof Plotly === "undefined") return;
    var fig = JSON.parse(data.textContent);
    var config = {responsive: true, displaylogo: false, showLink: false, showSendToCloud: false,
                  modeBarButtonsToRemove: ["sendDataToCloud"]};
    Plotly.newPlot(el, fig.data, fig.layout, config).then(function () {
      el.setAttribute("data-drawn", "true");
    });
    if (el.id === "fig-shapes") {
      el.on("plotly_click", function (ev) {
        var pt = ev && ev.points && ev.points[0];
        if (pt && pt.customdata) {
          var base = document.body.getAttribute("data-base") || "";
          window.location.href = base + "/problems/" + encodeURIComponent(pt.customdata[0]);
        }
      });
    }
  }

  function copier(button) {
    var target = document.getElementById(button.getAttribute("data-copy"));
    var status = button.parentNode.querySelector(".copied");
    if (!target) return;
    button.hidden = false;
    button.addEventListener("click", function () {
      var text = target.textContent;
      function done(ok) { if (status) status.textContent = ok ? "copied" : "select and copy by hand"; }
      if (navigator.clipboard && window.isSecureContext) {
        navigator.clipboard.writeText(text).then(function () { done(true); }, function () { fallback(); });
      } else {
        fallback();
      }
      function fallback() {
        var range = document.createRange();
        range.selectNodeContents(target);
        var sel = window.getSelection();
        sel.removeAllRanges();
        sel.addRange(range);
        var ok = false;
        try { ok = document.execCommand("copy"); } catch (e) { ok = false; }
        done(ok);
      }
    });
  }

  function init() {
    document.querySelectorAll("div.plot[data-figure]").forEach(draw);
    document.querySelectorAll("button.copy[data-copy]").forEach(copier);
  }

  if (document.readyState === "loading") {
    document.addEventListener("DOMContentLoaded", init);
  } else {
    init();
  }
})();
