"""Every exception class that db and service define derives from autotuner's one base."""

from __future__ import annotations

import importlib
import inspect
import pkgutil

import db
import service
from autotuner.errors import AutotunerError


def _modules(package):
    for info in pkgutil.walk_packages(package.__path__, package.__name__ + "."):
        if ".migrations" not in info.name:  # Alembic scripts: run by Alembic, not importable
            yield importlib.import_module(info.name)


def test_every_error_class_of_db_and_service_is_an_autotuner_error():
    found = {}
    for package in (db, service):
        for module in _modules(package):
            for name, cls in inspect.getmembers(module, inspect.isclass):
                if cls.__module__ == module.__name__ and issubclass(cls, BaseException):
                    found[f"{module.__name__}.{name}"] = cls
    assert {"db.errors.StorageError", "service.dashboard.query.BadParams"} <= set(found)
    assert [n for n, cls in found.items() if not issubclass(cls, AutotunerError)] == []
