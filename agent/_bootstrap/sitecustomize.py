"""llmwatch-instrument's hook into every Python process of the job (agent/instrument.py).

`llmwatch-instrument` puts this folder first on PYTHONPATH, so each interpreter the
command starts imports this module at start-up. It does nothing unless
$LLMWATCH_INSTRUMENT is set, and then only arms agent/instrument.py's lazy hooks;
any other `sitecustomize` further down the path is run too, as it would have been.
"""

import os
import sys


def _chain() -> None:
    here = os.path.dirname(os.path.abspath(__file__))
    import importlib.util

    for entry in sys.path:
        if not entry or os.path.abspath(entry) == here:
            continue
        candidate = os.path.join(entry, "sitecustomize.py")
        if os.path.isfile(candidate):
            spec = importlib.util.spec_from_file_location("_llmwatch_chained_sitecustomize", candidate)
            if spec is not None and spec.loader is not None:
                module = importlib.util.module_from_spec(spec)
                spec.loader.exec_module(module)
            return


if os.environ.get("LLMWATCH_INSTRUMENT") == "1":
    try:
        from agent.instrument import arm

        arm()
    except Exception as e:  # noqa: BLE001 - the job runs unwatched rather than not at all
        print(f"llmwatch-instrument: cannot arm the watch in this process: {e!r}", file=sys.stderr)
try:
    _chain()
except Exception as e:  # noqa: BLE001
    print(f"llmwatch-instrument: the next sitecustomize failed: {e!r}", file=sys.stderr)
