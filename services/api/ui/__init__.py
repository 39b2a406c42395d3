"""The dashboard at ``/ui``: server-rendered pages over the same repository functions the
JSON API serves (jobs with live stages, models with their artifacts per fingerprint key, the
fleet), behind the same tokens.

A browser signs in once with an API token (``/ui/login``); the token goes into an HttpOnly,
``SameSite=Strict`` cookie that the front door accepts under ``/ui`` only. Any role may look;
admins act, through POST forms carrying a CSRF token. Errors under ``/ui`` render as pages.
Templates ship as package data; the pages load nothing from any other host.
"""

from services.api.ui.pages import browser_paths, install_error_pages, router

__all__ = ["browser_paths", "install_error_pages", "router"]
