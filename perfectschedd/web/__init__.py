"""The HTTP side of the master (`http_listen`): the listener (server.py), who a client is
(credentials.py), the JSON API (api.py) and the routes by path (app.py).  It runs in the
master's process, on threads of its own; every command goes through the master's
dispatch, as the control socket's and D-Bus's do."""
