"""Memory: the planner's prediction and the tracer it runs on the meta device."""
