"""`llmwatch-instrument [options] -- COMMAND...`: watch a job without touching its code.

    llmwatch-instrument --collector http://127.0.0.1:8428 --token-file ~/.llmwatch/ingest \\
        -- torchrun --nproc-per-node 4 train.py --lr 3e-4

As `opentelemetry-instrument` does for services: the command runs with this
package's `_bootstrap/` first on PYTHONPATH, so every Python process it starts
(torchrun and each rank) imports its `sitecustomize` at start-up, which calls
`arm()` when $LLMWATCH_INSTRUMENT is 1. `arm()`:

1. turns the Flight Recorder on (agent/flight.py `enable_env`) before any process
   group exists;
2. once torch is imported, registers torch's global optimizer-step hooks and, until
   the model is found, global module-forward hooks that note the outermost module
   called with grad enabled;
3. at the first optimizer step (or its end, for a closure that runs the forward
   inside `step()`, as Lightning's), picks the outermost module whose parameters
   that optimizer holds, calls `agent.watch.watch(model, optimizer)` on them and
   takes its global hooks out: from then on the job costs what `watch()` costs.

Options fall back to $LLMWATCH_URL, $LLMWATCH_TOKEN_FILE (or $LLMWATCH_TOKEN) and
$LLMWATCH_RUN_ID; a run id not given is made once here (all ranks share it;
under a multi-node torchrun give `--run-id`, or the rendezvous id is used). Rank
and world size come from torch.distributed or torchrun's environment. The token
file's path travels in the environment, never the token.

`--policy` is the most the collector may do about this run: `shadow` by default
(every decision is still an `actions` row and a webhook, nothing is sent to the
job, which has no handler for it), `auto` to opt in, `off`.

The command's exit code is this command's (it replaces this process); no
command, or one that cannot be run, is a usage error (2) or 127.
"""

from __future__ import annotations

import argparse
import importlib.abc
import importlib.util
import logging
import os
import sys
import time
import uuid

log = logging.getLogger("llmwatch.agent")

_BOOTSTRAP = os.path.join(os.path.dirname(os.path.abspath(__file__)), "_bootstrap")
INSTRUMENT_ENV, POLICY_ENV = "LLMWATCH_INSTRUMENT", "LLMWATCH_POLICY"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="llmwatch-instrument",
        description="Run COMMAND (e.g. torchrun ... train.py) with every rank watched by llmwatch: steps, losses, "
                    "phases, every collective (torch's Flight Recorder), heartbeats and device health, with no "
                    "change to its code.",
        usage="llmwatch-instrument [options] -- COMMAND [ARGS...]")
    p.add_argument("--collector", metavar="URL", help="the collector's base URL (default: $LLMWATCH_URL)")
    p.add_argument("--token-file", metavar="F",
                   help="a file holding the ingest token (default: $LLMWATCH_TOKEN_FILE, else $LLMWATCH_TOKEN)")
    p.add_argument("--run-id", metavar="ID", help="the run's id (default: $LLMWATCH_RUN_ID, torchrun's rendezvous "
                                                  "id, else a new one)")
    p.add_argument("--policy", choices=("auto", "shadow", "off"), default=None,
                   help="the most the collector may do about this run (default: $LLMWATCH_POLICY, else shadow: "
                        "decisions are recorded and alerted, not sent)")
    p.add_argument("command", nargs=argparse.REMAINDER, help="the command to run, after --")
    return p


def environment(args: argparse.Namespace, environ: dict[str, str]) -> dict[str, str]:
    """The command's environment: the parent's plus what arms the watch in every rank."""
    from agent.flight import enable_env

    env = dict(environ)
    env[INSTRUMENT_ENV] = "1"
    env["PYTHONPATH"] = os.pathsep.join(p for p in (_BOOTSTRAP, environ.get("PYTHONPATH", "")) if p)
    if args.collector:
        env["LLMWATCH_URL"] = args.collector
    if args.token_file:
        env["LLMWATCH_TOKEN_FILE"] = os.path.abspath(args.token_file)
    run_id = args.run_id or environ.get("LLMWATCH_RUN_ID")
    if not run_id:
        run_id = f"run-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        env["LLMWATCH_RUN_ID_GENERATED"] = "1"  # a rank may prefer torchrun's rendezvous id (multi-node)
    env["LLMWATCH_RUN_ID"] = run_id
    env[POLICY_ENV] = args.policy or environ.get(POLICY_ENV) or "shadow"
    enable_env(env)
    return env


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    command = list(args.command)
    if command and command[0] == "--":
        command = command[1:]
    if not command:
        print("llmwatch-instrument: no command to run; usage: llmwatch-instrument [options] -- COMMAND [ARGS...]",
              file=sys.stderr)
        return 2
    if args.token_file and not os.path.isfile(args.token_file):
        print(f"llmwatch-instrument: --token-file {args.token_file}: no such file", file=sys.stderr)
        return 2
    env = environment(args, dict(os.environ))
    if not env.get("LLMWATCH_URL"):
        print("llmwatch-instrument: no collector (--collector or $LLMWATCH_URL): the job runs unwatched",
              file=sys.stderr)
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execvpe(command[0], command, env)  # the job's exit code is ours
    except OSError as e:
        print(f"llmwatch-instrument: cannot run {command[0]!r}: {e.strerror or e}", file=sys.stderr)
        return 127
    return 0  # not reached


# -- inside each process of the job --------------------------------------------------------
class _AfterImport(importlib.abc.MetaPathFinder):
    """Runs `then()` right after the module `name` finished importing (once)."""

    def __init__(self, name: str, then) -> None:
        self.name, self.then = name, then

    def find_spec(self, fullname, path, target=None):
        if fullname != self.name:
            return None
        sys.meta_path.remove(self)
        spec = importlib.util.find_spec(fullname)
        if spec is None or spec.loader is None:
            return spec
        exec_module, then = spec.loader.exec_module, self.then

        def exec_and_then(module):
            exec_module(module)
            try:
                then()
            except Exception as e:  # noqa: BLE001 - the job goes on unwatched
                print(f"llmwatch-instrument: cannot hook torch: {e!r}", file=sys.stderr)

        spec.loader.exec_module = exec_and_then
        return spec


def arm() -> None:
    """In a process of an instrumented job: hook torch when it is imported (see module doc)."""
    from agent.flight import enable_env

    enable_env(os.environ)
    if "torch" in sys.modules:
        _on_torch()
    else:
        sys.meta_path.insert(0, _AfterImport("torch", _on_torch))


def _on_torch() -> None:
    from agent.watch import _Patches

    _Patches.preinstall_clip()  # before the script's own `from torch.nn.utils import clip_grad_norm_`
    _Discovery().install()


def _is_llmwatch_trainer() -> bool:
    """This process is a rank of the llmwatch trainer (`python -m trainer`, under torchrun or
    its own launcher), not a job that merely imported something of ours."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    return os.environ.get("LLMWATCH_EMBEDDED") == "1" or getattr(spec, "name", "") in ("trainer", "trainer.__main__")


class _Discovery:
    """Finds the model and optimizer of the first optimizer step, then watches them."""

    def __init__(self) -> None:
        self._handles: list = []
        self._roots: list = []  # weakrefs of the outermost modules called with grad, newest last
        self._depth = 0
        self.watch = None

    def install(self) -> None:
        from torch.nn.modules.module import register_module_forward_hook, register_module_forward_pre_hook
        from torch.optim.optimizer import register_optimizer_step_post_hook, register_optimizer_step_pre_hook

        self._handles = [register_module_forward_pre_hook(self._fwd_pre),
                         register_module_forward_hook(self._fwd_post, always_call=True),
                         register_optimizer_step_pre_hook(self._opt_pre),
                         register_optimizer_step_post_hook(self._opt_post)]

    def _fwd_pre(self, module, args) -> None:
        import torch

        if self._depth == 0 and module.training and torch.is_grad_enabled():
            import weakref

            ref = weakref.ref(module)
            if ref not in self._roots:
                self._roots.append(ref)
                del self._roots[:-8]
        self._depth += 1

    def _fwd_post(self, module, args, output) -> None:
        self._depth = max(0, self._depth - 1)

    def _opt_pre(self, opt, args, kwargs) -> None:
        if self.watch is None:
            self._attach(opt, final=False)

    def _opt_post(self, opt, args, kwargs) -> None:
        if self.watch is None:
            self._attach(opt, final=True)

    def _attach(self, opt, *, final: bool) -> None:
        if _is_llmwatch_trainer():  # its own comm layer and agent record it all: one source
            self.watch = False
            return
        owned = {id(p) for g in opt.param_groups for p in g["params"]}
        best, best_n = None, 0
        for ref in reversed(self._roots):
            m = ref()
            if m is None:
                continue
            n = sum(1 for p in m.parameters() if id(p) in owned)
            if n > best_n:
                best, best_n = m, n
        if best is None and not final:
            return  # a closure runs the forward inside step(): look again at its end
        # the module hooks go; the optimizer hooks stay (torch is iterating over them now) and
        # return at once from here on
        for h in self._handles[:2]:
            h.remove()
        self._handles, self._roots = self._handles[2:], []
        if best is None:
            log.warning("llmwatch-instrument: no module called before the first optimizer step holds its "
                        "parameters: steps and collectives are recorded, phases and the loss are not")
        try:
            from agent.watch import watch

            policy = os.environ.get(POLICY_ENV, "shadow")
            run_id = os.environ.get("LLMWATCH_RUN_ID")
            rdzv = os.environ.get("TORCHELASTIC_RUN_ID", "")
            if os.environ.get("LLMWATCH_RUN_ID_GENERATED") and rdzv and rdzv != "none":
                run_id = f"rdzv-{rdzv}"  # every node of a multi-node torchrun shares it
            # found at the end of a step (a closure's): that step is done, the watch counts from the next
            self.watch = watch(best, opt, run_id=run_id, start_step=1 if final else 0,
                               run_info={"source": "instrument", "policy": policy, "argv": sys.argv[:32]})
        except Exception as e:  # noqa: BLE001 - the job goes on unwatched
            self.watch = False
            print(f"llmwatch-instrument: cannot start the watch: {e!r}", file=sys.stderr)


if __name__ == "__main__":
    sys.exit(main())
