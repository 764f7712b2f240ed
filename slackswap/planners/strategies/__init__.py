"""One module per planner strategy. The registry imports every module of this package, so adding a
planner is one module here (decorated with `@register_planner`) and one `conf/planner/<name>.yaml`."""
