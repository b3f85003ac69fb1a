"""The composition root: the `hisparse` command line (serve, generate, plan, bench, train) and the Ray Serve
application. It assembles the system from the packages below it, and nothing below imports it."""
