"""The command line's command groups (alerts, collect, dashboards, governor, roi), mounted by prunewatch.cli."""
