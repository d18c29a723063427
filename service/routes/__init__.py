"""One router per resource."""

from service.routes import (
           benches,
           demand,
           evidence,
           health,
           jobs,
           lookup,
           problems,
           results,
           snapshot,
)

ROUTERS = [lookup.router, results.router, jobs.router, problems.router, demand.router,
           snapshot.router, evidence.router, benches.router, health.router]

__all__ = ["ROUTERS"]
