"""The route-store client every process uses: ``RouteStore`` and its parts."""
