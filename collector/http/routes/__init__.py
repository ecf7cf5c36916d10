"""HTTP routes, one thin module per resource; no SQL here (see collector/read/)."""
