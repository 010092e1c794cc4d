"""Pure planning: what a model costs, where its layers go, which layout wins."""
