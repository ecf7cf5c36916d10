"""A request body into rows: decoding and validating a batch, its columns as Arrow tables, OTLP metrics."""
