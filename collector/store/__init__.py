"""The one writer and what a group commit is made of: the schema, the projections, the post-commit feed."""
