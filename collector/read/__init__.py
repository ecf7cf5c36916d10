"""The read side: the queries, the dashboard's aggregate views and goodput, plain functions over a cursor."""
