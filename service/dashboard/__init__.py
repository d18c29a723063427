"""The dashboard, served by the service at ``/``: an overview, a server-side table of the tuned
problems (``/problems``) and a page per problem (``/problems/{id}``), with plotly figures drawn
by the locally served plotly.js (``/static/plotly.min.js``, from the installed package).

``create_app`` includes :data:`router` and gives the app its :class:`Assets`; nothing here
writes to the database.
"""

from service.dashboard.assets import Assets
from service.dashboard.routes import router

__all__ = ["Assets", "router"]
