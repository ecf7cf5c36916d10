"""What read-only SQL may name: the allow-list `collector/sql/guard.py` checks every statement against.

DuckDB's catalog holds far more than an analyst of a training run needs, and some
of it acts (checkpoint(), truncate_duckdb_logs()), reads (read_blob() of the
database file, query()), executes SQL handed to it as data
(json_execute_serialized_sql()), reveals settings (current_setting(),
duckdb_settings()), or makes one uninterruptible call build gigabytes
(repeat('a', 1e9)). A deny-list of those loses to the next function DuckDB adds,
so the guard admits only what is named here; anything else is refused with its
name before the statement runs.

How to extend it: add the name to the one set it belongs to below (a scalar to the
group it fits, an aggregate to AGGREGATES, ...). A function qualifies when it (1)
touches nothing but its arguments (no file, no setting, no session state, no
catalog), and (2) cannot make its output much larger than its inputs in one call:
DuckDB checks for an interrupt between operators, not inside one, so one call that
turns 10 bytes into 1 GB runs to its end whatever the timeout, and nothing bounds
the memory it takes (memory_limit covers DuckDB's buffer pool only). A function
whose size depends on an argument (a width, a count) is allowed only with a rule
in ARG_RULES that bounds that argument. tests/unit/collector/test_sqlallow.py
checks that every name exists in DuckDB and that the cookbook still runs.

The relations are the project's tables and views, read from collector/store/schema.py's
migrations, so a migration that adds a table makes it queryable.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence

from collector.store.schema import MIGRATIONS


# -- relations -------------------------------------------------------------------
def project_relations(migrations: Sequence[tuple[int, Sequence[str]]] = MIGRATIONS) -> frozenset[str]:
    """Tables and views the migrations create (less what they drop or rename away)."""
    names: set[str] = {"schema_version"}  # created by schema.current_version, outside the migrations
    create = re.compile(r"^\s*CREATE\s+(?:OR\s+REPLACE\s+)?(?:TABLE|VIEW)\s+(?:IF\s+NOT\s+EXISTS\s+)?(\w+)", re.I)
    drop = re.compile(r"^\s*DROP\s+(?:TABLE|VIEW)\s+(?:IF\s+EXISTS\s+)?(\w+)", re.I)
    rename = re.compile(r"^\s*ALTER\s+(?:TABLE|VIEW)\s+(\w+)\s+RENAME\s+TO\s+(\w+)", re.I)
    for _, statements in sorted(migrations):
        for sql in statements:
            if m := create.match(sql):
                names.add(m.group(1).lower())
            elif m := drop.match(sql):
                names.discard(m.group(1).lower())
            elif m := rename.match(sql):
                names.discard(m.group(1).lower())
                names.add(m.group(2).lower())
    return frozenset(names)


RELATIONS = project_relations()
# information_schema.<name>, for discovering the above (it lists the catalog's names, no rows).
DISCOVERY_RELATIONS = frozenset({"tables", "columns", "views", "schemata"})
# SHOW TABLES, SHOW ALL TABLES (as the parser names them); DESCRIBE/SUMMARIZE are checked as queries.
SHOW_SPECIALS = frozenset({"tables", "__show_tables_expanded"})

# -- table functions (FROM f(...)) ---------------------------------------------------
# Rows come out chunk by chunk, so a big range() is interruptible like any scan.
TABLE_FUNCTIONS = frozenset({"range", "generate_series", "unnest", "json_each", "json_tree"})

# -- scalar functions, by group -----------------------------------------------------
OPERATORS = frozenset({  # function names the parser gives operators
    "+", "-", "*", "/", "//", "%", "**", "^", "@", "!__postfix",
    "&", "|", "~", "<<", ">>", "xor",
    "||", "~~", "!~~", "~~*", "!~~*", "~~~", "^@",  # concat, LIKE, NOT LIKE, ILIKE, NOT ILIKE, GLOB, starts with
    "->>", "@>", "<@", "&&",  # JSON text extraction, list containment and overlap
})
MATH = frozenset({
    "abs", "acos", "acosh", "add", "asin", "asinh", "atan", "atan2", "atanh", "cbrt", "ceil", "ceiling", "cos",
    "cosh", "cot", "degrees", "divide", "even", "exp", "factorial", "fdiv", "floor", "fmod", "gamma", "gcd",
    "greatest", "greatest_common_divisor", "isfinite", "isinf", "isnan", "lcm", "least", "least_common_multiple",
    "lgamma", "ln", "log", "log10", "log2", "mod", "multiply", "nextafter", "pi", "pow", "power", "radians",
    "random", "round", "round_even", "roundbankers", "sign", "signbit", "sin", "sinh", "sqrt", "subtract", "tan",
    "tanh", "trunc", "bit_count",
})
STRING = frozenset({
    "ascii", "bit_length", "chr", "concat", "concat_ws", "contains", "ends_with", "starts_with", "prefix", "suffix",
    "instr", "strpos", "position", "left", "right", "len", "length", "char_length", "character_length",
    "octet_length", "strlen", "lower", "upper", "lcase", "ucase", "ltrim", "rtrim", "trim", "reverse",
    "split_part", "string_split", "str_split", "string_to_array", "split", "substr", "substring", "translate",
    "strip_accents", "nfc_normalize", "unicode", "ord", "hamming", "mismatches", "md5", "sha1", "sha256", "hash",
    "hex", "to_hex", "unhex", "from_hex", "bin", "to_binary", "from_binary", "base64", "to_base64",
    "from_base64", "encode", "decode", "url_encode", "url_decode", "format_bytes", "formatReadableSize",
    "formatReadableDecimalSize", "pg_size_pretty", "like_escape", "not_like_escape", "ilike_escape",
    "not_ilike_escape", "uuid", "gen_random_uuid", "uuidv4", "uuidv7",
    "replace", "lpad", "rpad", "format", "printf", "bar",  # with ARG_RULES
})
REGEX = frozenset({
    "regexp_matches", "regexp_full_match", "regexp_extract", "regexp_extract_all", "regexp_split_to_array",
    "string_split_regex", "str_split_regex", "regexp_escape", "regexp_split_to_table",
    "regexp_replace",  # with ARG_RULES
})
DATETIME = frozenset({
    "age", "ago", "century", "current_date", "current_localtime", "current_localtimestamp", "get_current_time",
    "get_current_timestamp", "now", "today", "transaction_timestamp", "date_add", "date_diff", "datediff",
    "date_part", "datepart", "date_sub", "datesub", "date_trunc", "datetrunc", "day", "dayname", "dayofmonth",
    "dayofweek", "dayofyear", "days_in_month", "decade", "epoch", "epoch_ms", "epoch_ns", "epoch_us", "era",
    "hour", "isodow", "isoyear", "julian", "last_day", "make_date", "make_time", "make_timestamp",
    "make_timestamp_ms", "make_timestamp_ns", "make_timestamptz", "microsecond", "millennium", "millisecond",
    "minute", "month", "monthname", "nanosecond", "normalized_interval", "quarter", "second", "strftime",
    "strptime", "try_strptime", "time_bucket", "timezone", "timezone_hour", "timezone_minute", "to_timestamp",
    "to_centuries", "to_days", "to_decades", "to_hours", "to_microseconds", "to_millennia", "to_milliseconds",
    "to_minutes", "to_months", "to_quarters", "to_seconds", "to_weeks", "to_years", "week", "weekday",
    "weekofyear", "year", "yearweek",
})
JSON = frozenset({
    "json", "json_extract", "json_extract_string", "json_extract_path", "json_extract_path_text", "json_value",
    "json_exists", "json_keys", "json_array_length", "json_type", "json_valid", "json_structure", "json_contains",
    "json_transform", "json_transform_strict", "from_json", "from_json_strict", "to_json", "json_object",
    "json_array", "json_quote", "json_merge_patch", "json_pretty", "array_to_json", "row_to_json",
})
LIST = frozenset({  # lists, structs and maps; no lambdas (list_transform(l, x -> big) multiplies in one call)
    "list_value", "list_pack", "array_value", "list_extract", "list_element", "array_extract", "element_at",
    "list_slice", "array_slice", "array_length", "cardinality", "list_contains", "list_has", "array_contains",
    "array_has", "list_position", "list_indexof", "array_position", "array_indexof", "list_has_any",
    "list_has_all", "array_has_any", "array_has_all", "list_intersect", "array_intersect", "list_sort",
    "list_reverse_sort", "array_sort", "array_reverse_sort", "list_distinct", "array_distinct", "list_unique",
    "array_unique", "list_concat", "list_cat", "array_concat", "array_cat", "list_append", "array_append",
    "array_push_back", "list_prepend", "array_prepend", "array_push_front", "array_pop_back", "array_pop_front",
    "list_reverse", "array_reverse", "flatten", "list_zip", "array_zip", "list_where", "array_where",
    "list_select", "array_select", "list_grade_up", "array_grade_up", "grade_up", "list_first", "list_last",
    "list_any_value", "list_count", "list_sum", "list_product", "list_avg", "list_min", "list_max",
    "list_median", "list_mode", "list_stddev_samp", "list_stddev_pop", "list_var_samp", "list_var_pop",
    "list_entropy", "list_kurtosis", "list_skewness", "list_mad", "list_sem", "list_bool_and", "list_bool_or",
    "list_histogram", "list_approx_count_distinct", "list_string_agg", "array_to_string", "unnest",
    "list_dot_product", "list_inner_product", "list_cosine_similarity", "list_cosine_distance",
    "list_distance", "array_dot_product", "array_inner_product", "array_cosine_similarity",
    "array_cosine_distance", "array_distance",
    "list_aggregate", "list_aggr", "array_aggregate", "array_aggr", "aggregate",  # with ARG_RULES
    "struct_pack", "struct_extract", "struct_extract_at", "struct_insert", "struct_keys", "struct_values",
    "struct_concat", "row", "map", "map_extract", "map_extract_value", "map_keys", "map_values", "map_entries",
    "map_from_entries", "map_contains", "map_contains_value", "map_concat",
    "union_extract", "union_tag", "union_value",
    "equi_width_bins",  # with ARG_RULES
})
CONDITIONAL = frozenset({"if", "ifnull", "nullif", "coalesce", "typeof", "pg_typeof"})
AGGREGATES = frozenset({
    "any_value", "approx_count_distinct", "approx_quantile", "approx_top_k", "arbitrary", "arg_max",
    "arg_max_null", "arg_max_nulls_last", "arg_min", "arg_min_null", "arg_min_nulls_last", "argmax", "argmin",
    "array_agg", "avg", "bit_and", "bit_or", "bit_xor", "bool_and", "bool_or", "corr", "count", "count_if",
    "count_star", "countif", "covar_pop", "covar_samp", "entropy", "favg", "first", "fsum", "geomean",
    "geometric_mean", "group_concat", "histogram", "histogram_exact", "json_group_array", "json_group_object",
    "json_group_structure", "kahan_sum", "kurtosis", "kurtosis_pop", "last", "list", "listagg", "mad", "max",
    "max_by", "mean", "median", "min", "min_by", "mode", "product", "quantile", "quantile_cont",
    "quantile_disc", "regr_avgx", "regr_avgy", "regr_count", "regr_intercept", "regr_r2", "regr_slope",
    "regr_sxx", "regr_sxy", "regr_syy", "sem", "skewness", "stddev", "stddev_pop", "stddev_samp", "string_agg",
    "sum", "sumkahan", "var_pop", "var_samp", "variance", "wavg", "weighted_avg",
})
WINDOW_FUNCTIONS = frozenset({
    "cume_dist", "dense_rank", "fill", "first_value", "last_value", "lag", "lead", "nth_value", "ntile",
    "percent_rank", "rank", "rank_dense", "row_number",
})
SCALARS = MATH | STRING | REGEX | DATETIME | JSON | LIST | CONDITIONAL
# Syntax the binder handles itself: a FUNCTION node in the parse tree, not in duckdb_functions().
BINDER_FUNCTIONS = frozenset({"unnest", "ifnull", "coalesce"})

# -- expression, query and FROM shapes (json_serialize_sql's names) ----------------------
EXPRESSION_CLASSES = frozenset({
    "BETWEEN", "CASE", "CAST", "COLLATE", "COLUMN_REF", "COMPARISON", "CONJUNCTION", "CONSTANT", "DEFAULT",
    "FUNCTION", "LAMBDA", "LAMBDA_REF", "OPERATOR", "PARAMETER", "POSITIONAL_REFERENCE", "STAR", "SUBQUERY",
    "TYPE", "WINDOW",
})
OPERATOR_TYPES = frozenset({
    "OPERATOR_NOT", "OPERATOR_IS_NULL", "OPERATOR_IS_NOT_NULL", "OPERATOR_COALESCE", "OPERATOR_NULLIF",
    "OPERATOR_TRY", "COMPARE_IN", "COMPARE_NOT_IN", "ARRAY_EXTRACT", "ARRAY_SLICE", "STRUCT_EXTRACT",
    "ARRAY_CONSTRUCTOR", "GROUPING_FUNCTION",
})
QUERY_NODES = frozenset({"SELECT_NODE", "SET_OPERATION_NODE", "RECURSIVE_CTE_NODE", "CTE_NODE"})
TABLE_REFS = frozenset({"BASE_TABLE", "SUBQUERY", "JOIN", "TABLE_FUNCTION", "EXPRESSION_LIST", "EMPTY", "PIVOT",
                        "SHOW_REF"})

# -- argument rules ----------------------------------------------------------------
# A rule gets the call's arguments, each a Python value for a literal or VARIES for
# anything computed, and returns why the call is refused (None: it may run).
VARIES = object()
MAX_WIDTH_CHARS = 1000  # lpad/rpad/bar widths, format/printf field widths and precisions
MAX_BINS = 10_000  # equi_width_bins
MAX_GROWTH = 4  # replace()/regexp_replace(): output at most this many times the input (+ a constant)
MAX_TOP_N = 10_000  # approx_top_k's k, the n of max(x, n), arg_max(x, y, n), ...: state per group, kept outside
                    # DuckDB's memory limit (approx_top_k(i, 999999) over 1000 groups took 6.6 GB here)


def _literal_int_at_most(args: Sequence[object], index: int, limit: int, what: str, *, optional: bool = False
                         ) -> str | None:
    if index >= len(args):
        return None if optional else f"needs its {what}"
    v = args[index]
    if isinstance(v, bool) or not isinstance(v, int) or not 0 <= v <= limit:
        return f"its {what} must be a literal integer from 0 to {limit}"
    return None


_FMT_FIELD = re.compile(r"\{[^{}]*\}|\{")
_PRINTF_SPEC = re.compile(r"%[^a-zA-Z%]*[a-zA-Z%]")


def _format_rule(args: Sequence[object]) -> str | None:
    """format('{:>1000000000}', x) pads in one call: widths and precisions stay small."""
    fmt = args[0] if args else VARIES
    if not isinstance(fmt, str):
        return "its format string must be a literal"
    for m in _FMT_FIELD.finditer(fmt.replace("{{", "").replace("}}", "")):
        field = m.group(0)
        if field == "{" or "{" in field[1:] or any(int(n) > MAX_WIDTH_CHARS for n in re.findall(r"\d+", field)):
            return f"field widths and precisions must be literal and at most {MAX_WIDTH_CHARS}"
    return None


def _printf_rule(args: Sequence[object]) -> str | None:
    fmt = args[0] if args else VARIES
    if not isinstance(fmt, str):
        return "its format string must be a literal"
    for m in _PRINTF_SPEC.finditer(fmt):
        spec = m.group(0)
        if "*" in spec or any(int(n) > MAX_WIDTH_CHARS for n in re.findall(r"\d+", spec)):
            return f"field widths and precisions must be literal and at most {MAX_WIDTH_CHARS}"
    return None


def _replace_rule(args: Sequence[object]) -> str | None:
    """replace(s, 'a', <1000 chars>) multiplies s by 1000 in one call; nested three
    deep that took 18 GB and 50 s here. The replacement may be at most MAX_GROWTH
    times as long as what it replaces."""
    old, new = (list(args[1:3]) + [VARIES, VARIES])[:2]
    if not isinstance(old, str) or not isinstance(new, str) or not old:
        return "the text it replaces and its replacement must be literals (a non-empty one to replace)"
    if len(new) > MAX_GROWTH * len(old):
        return f"its replacement may be at most {MAX_GROWTH} times as long as the text it replaces"
    return None


def _regexp_replace_rule(args: Sequence[object]) -> str | None:
    """A pattern may match everywhere (even the empty string between characters), and
    backreferences copy the match: the replacement is a short literal without them."""
    new = args[2] if len(args) > 2 else VARIES
    if not isinstance(new, str) or "\\" in new or len(new) > MAX_GROWTH - 1:
        return (f"its replacement must be a literal of at most {MAX_GROWTH - 1} characters "
                "without backreferences")
    return None


def _aggregate_name_rule(args: Sequence[object]) -> str | None:
    name = args[1] if len(args) > 1 else VARIES
    if not isinstance(name, str) or name.lower() not in AGGREGATES:
        return "its aggregate must be a literal name of an allowed aggregate"
    return None


ARG_RULES: dict[str, Callable[[Sequence[object]], str | None]] = {
    "lpad": lambda a: _literal_int_at_most(a, 1, MAX_WIDTH_CHARS, "length"),
    "rpad": lambda a: _literal_int_at_most(a, 1, MAX_WIDTH_CHARS, "length"),
    "bar": lambda a: _literal_int_at_most(a, 3, MAX_WIDTH_CHARS, "width", optional=True),
    "equi_width_bins": lambda a: _literal_int_at_most(a, 2, MAX_BINS, "bin count"),
    "format": _format_rule,
    "printf": _printf_rule,
    "replace": _replace_rule,
    "regexp_replace": _regexp_replace_rule,
    **{n: _aggregate_name_rule for n in ("list_aggregate", "list_aggr", "array_aggregate", "array_aggr",
                                         "aggregate")},
    "approx_top_k": lambda a: _literal_int_at_most(a, 1, MAX_TOP_N, "k"),
    **{n: (lambda a: _literal_int_at_most(a, 1, MAX_TOP_N, "n", optional=True)) for n in ("min", "max")},
    **{n: (lambda a: _literal_int_at_most(a, 2, MAX_TOP_N, "n", optional=True))
       for n in ("arg_max", "arg_min", "argmax", "argmin", "max_by", "min_by", "arg_max_null", "arg_min_null",
                 "arg_max_nulls_last", "arg_min_nulls_last")},
}

# Why some well-known names are missing, for the refusal message (the rest: "not on the allow-list").
WHY_NOT = {
    "repeat": "one call can build gigabytes and cannot be interrupted",
    "range": "as a scalar it builds a whole list in one call; use FROM range(n)",
    "generate_series": "as a scalar it builds a whole list in one call; use FROM generate_series(a, b)",
    "list_resize": "one call can build gigabytes", "array_resize": "one call can build gigabytes",
    "to_base": "its padding can build gigabytes in one call",
    "list_transform": "lambdas can multiply a value in one call", "list_apply": "lambdas can multiply a value",
    "array_transform": "lambdas can multiply a value", "apply": "lambdas can multiply a value",
    "list_reduce": "lambdas can multiply a value", "list_filter": "lambdas are not allowed",
    "levenshtein": "its cost grows with the product of the lengths, in one uninterruptible call",
    "damerau_levenshtein": "its cost grows with the product of the lengths, in one uninterruptible call",
    "sleep_ms": "it only waits", "pg_sleep": "it only waits",
    "current_setting": "settings are not readable", "getvariable": "session state is not readable",
    "query": "it runs SQL given as a string", "query_table": "it reads a table named by a string",
    "json_execute_serialized_sql": "it runs SQL given as data", "json_serialize_sql": "it is the guard's tool",
    "json_deserialize_sql": "it is the guard's tool", "json_serialize_plan": "it plans SQL given as a string",
    "checkpoint": "it acts on the database", "force_checkpoint": "it acts on the database",
    "truncate_duckdb_logs": "it acts on the database", "write_log": "it writes to DuckDB's log",
    "setseed": "it changes session state",
}
