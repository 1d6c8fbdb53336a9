"""The `inferscale` command line.

    inferscale demo [--model DIR] [--w N] [--k N] [--questions N] [--max-new-tokens N] [--kernels K] [--verbose]
    inferscale memory --root DIR add|search|list|update|delete|delete-user|history|update-turn|delete-turn ...
    inferscale serve [--model DIR] [--store DIR] [--host ADDR] [--port N] [--config FILE] [--api-keys FILE] [--verbose] ...
    inferscale models list | add NAME
    inferscale calibrate --memory-root DIR [--model M] [--data SOURCES] [--work-dir DIR] [--k 10,50] ...

`--model` takes a Hugging Face folder or a short name from `inferscale models list`.

Each subcommand registers its parser in `build_parser` and handles its arguments in a `_cmd_*`
function, which imports what it needs (jax, torch, rich) itself: `inferscale --help` stays fast
and works without them. Bad input (ValueError, FileNotFoundError, store errors) is reported as
`error: <message>` on stderr with exit code 2, without a traceback.

`demo` and `serve` show their own progress and results: vLLM's logs (the engine-core and worker
processes' too) stay at WARNING unless `--verbose` or the `VLLM_LOGGING_LEVEL` environment
variable asks for more (`engine_environment`, called before vLLM is imported).
"""

from __future__ import annotations

import argparse
import os
import sys
from typing import MutableMapping, Sequence

USAGE_ERROR = 2
INTERRUPTED = 130
QUIET_VLLM_LEVEL = "WARNING"
VERBOSE_HELP = "show vLLM's INFO logs (default: warnings and errors only; VLLM_LOGGING_LEVEL, when set, decides)"


def engine_environment(verbose: bool = False, environ: MutableMapping[str, str] | None = None) -> None:
    """Prepare the environment of a command that starts vLLM, before vLLM is imported (vLLM reads
    `VLLM_LOGGING_LEVEL` at import; its engine-core and worker processes inherit the environment):
    vLLM logs at WARNING unless `verbose` (vLLM's own default, INFO); a level the user set is kept."""
    environ = os.environ if environ is None else environ
    if not verbose:
        environ.setdefault("VLLM_LOGGING_LEVEL", QUIET_VLLM_LEVEL)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="inferscale",
        description="A memory layer for LLM serving: facts encoded once as KV, injected into the paged cache.",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    _add_demo(sub)
    from inferscale.cli.memory_commands import add_parser as add_memory

    add_memory(sub)
    from inferscale.cli.serve_command import add_parser as add_serve

    add_serve(sub)
    _add_models(sub)
    _add_calibrate(sub)
    return parser


def _add_calibrate(sub) -> None:
    from inferscale.config import EngineSettings, add_flags  # plain Python: no engine

    def ints(text: str) -> tuple[int, ...]:
        try:
            return tuple(int(x) for x in text.split(",") if x.strip())
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None

    p = sub.add_parser("calibrate", help="measure recovery policies against text and write the model's gate",
                       description="Answer held-in LoCoMo questions with the facts as text and injected under each "
                                   "recovery policy, and write calibration.json into the memory root: per k the "
                                   "cheapest policy non-inferior to text within the tolerance (memory.mode auto "
                                   "serves it).")
    d = argparse.SUPPRESS
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--memory-root", "--store", dest="memory_root", metavar="DIR",
                       help="the served model's memory root (calibration.json is written there)")
    where.add_argument("--ship", action="store_true", default=d,
                       help="write it into the package's shipped calibrations (inferscale/gate/calibrations/), "
                            "which every memory root of this model uses when it has none of its own")
    p.add_argument("--model", default=d, help="folder or short name (default: the packaged SmolLM2-135M-Instruct)")
    p.add_argument("--data", default=d,
                   help="where the conversations come from, comma-separated: locomo (the checkout's LoCoMo), "
                        "assistant (the packaged user-and-assistant conversations), demo, or LoCoMo-format files "
                        "(default: locomo,assistant)")
    p.add_argument("--conversation", dest="conversations", default=d,
                   type=lambda v: tuple(x.strip() for x in v.split(",") if x.strip()),
                   help="sample ids, comma-separated (default: the first three of each source); a policy must "
                        "pass on every one")
    p.add_argument("--questions", type=int, default=d, help="held-in questions (default: 40)")
    p.add_argument("--k", type=ints, default=d, help="k values to calibrate (default: 10,50)")
    p.add_argument("--policies", type=lambda s: tuple(x.strip() for x in s.split(",") if x.strip()), default=d,
                   help="policies to try (default: none,near:5,top:2,top:5,heads:4,heads:8)")
    p.add_argument("--tolerance", type=float, default=d,
                   help="how much worse than text a policy may be, in points of gold-token recall (and J when "
                        "judged) as a fraction: a policy is kept when its pooled gap's one-sided 95%% upper bound "
                        "(Holm over the policies) is within it and no conversation is significantly worse "
                        "(default: 0.05 = 5 points; docs/quality.md says which tolerance a number of questions "
                        "resolves)")
    # the memory and engine it calibrates, as the server will serve them: `serve`'s own flags (one definition)
    add_flags(p, EngineSettings, ("w", "context", "memory_boundary", "kv_dtype", "encode_mode", "dtype"))
    p.add_argument("--max-tokens", dest="max_tokens", type=int, default=d, help="answer tokens (default: 32)")
    p.add_argument("--ttft-questions", dest="ttft_questions", type=int, default=d,
                   help="also time each method's end-to-end time to first token on this many questions, in the "
                        "same run (default: 0)")
    p.add_argument("--work-dir", dest="work_dir", default=d, metavar="DIR",
                   help="keep the calibration's memory and each conversation's measurements in DIR (one model per "
                        "DIR): a rerun with the same settings measures only what is missing")
    p.add_argument("--remeasure", action="store_true", default=d,
                   help="measure every conversation again; by default a conversation already in the work dir or "
                        "in the calibration file written (the memory root's, or with --ship the package's) "
                        "under the same settings is reused, so a rerun with more conversations extends it")
    p.add_argument("--quick", action="store_true", default=d,
                   help="minutes instead of hours: 12 questions, k=10, policies none,top:2 (flags given win); "
                        "every gap is reported with its standard error")
    p.set_defaults(func=_cmd_calibrate)


def _cmd_calibrate(args: argparse.Namespace) -> int:
    import os

    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    from inferscale.evaluation.calibrate import calibrate

    calibrate(calibrate_config(args), log=lambda m: print(m, flush=True))
    return 0


def calibrate_config(args: argparse.Namespace):
    """`inferscale calibrate`'s flags as a `CalibrateConfig` (`--quick` presets; flags given win)."""
    from inferscale.evaluation.calibrate import CalibrateConfig

    from inferscale.config import EngineSettings

    given = {k: v for k, v in vars(args).items() if k not in ("command", "func", "quick") and v is not None}
    if getattr(args, "quick", False):
        given = {**CalibrateConfig.QUICK, **given}
    own = CalibrateConfig.__dataclass_fields__  # `tolerance` is the calibration's own: the one it decides at
    settings = {f: given.pop(f) for f in EngineSettings.__dataclass_fields__ if f in given and f not in own}
    return CalibrateConfig(**{"memory_root": "", **given}, settings=EngineSettings(**settings))


def _add_models(sub) -> None:
    p = sub.add_parser("models", help="models by short name: list them, add an evaluation model",
                       description="List the models --model accepts by name, or install one: its packages are "
                                   "installed with pip, assembled, verified and converted once into the cache.")
    cmds = p.add_subparsers(dest="models_command", metavar="ACTION", required=True)
    cmds.add_parser("list", help="known models and whether they are installed")
    a = cmds.add_parser("add", help="install, assemble, verify and convert a model")
    a.add_argument("name", help="a name from `inferscale models list`")
    p.set_defaults(func=_cmd_models)


def _cmd_models(args: argparse.Namespace) -> int:
    from inferscale.models import add_model, list_models

    if args.models_command == "add":
        print(add_model(args.name, log=lambda m: print(m, flush=True)))
        return 0
    for m in list_models():
        print(f"{m['name']:<22} {'installed' if m['installed'] else 'not installed':<14} {m['title']}: {m['note']}")
    return 0


def _add_demo(sub) -> None:
    # Defaults are left to DemoConfig (flags not given are not passed); the help repeats them,
    # and tests/test_cli.py checks the two agree.
    p = sub.add_parser("demo", help="a short chat over the demo memory, served with the memory injected and as text",
                       description="Encode the demo conversation's facts once, then serve a short chat with a "
                                   "system prompt through vLLM and InferScale's connector: every turn is answered "
                                   "with the memory's KV injected and with the same facts prefilled as text, "
                                   "their times to first token side by side, and what memory.mode auto serves. "
                                   "--engine jax runs the JAX research engine instead (joint prefill vs injection).")
    from inferscale.config import EngineSettings, add_flags  # plain Python: no engine

    d = argparse.SUPPRESS
    p.add_argument("--model", default=d, metavar="DIR",
                   help="Hugging Face model folder (default: the packaged SmolLM2-135M-Instruct)")
    add_flags(p, EngineSettings, ("w",))
    p.add_argument("--questions", type=int, default=d, metavar="N",
                   help="number of demo questions to answer (default: 5)")
    p.add_argument("--max-new-tokens", type=int, default=d, metavar="N",
                   help="tokens generated per answer (default: 40)")
    p.add_argument("--engine", default=d, metavar="E",
                   help="vllm (default: the product, vLLM + the InferScale connector) or jax (the research engine)")
    p.add_argument("--kernels", default=d, metavar="K",
                   help="--engine jax: auto, reference or pallas (default: auto = Pallas on GPU, reference on CPU)")
    p.add_argument("--k", type=int, default=d, metavar="N", help="facts retrieved per question (default: 10)")
    p.add_argument("--memory-root", dest="memory_root", default=d, metavar="DIR",
                   help="where the model's calibration (the quality gate) is read from (default: "
                        "~/.cache/inferscale/memory, the server's)")
    p.add_argument("--verbose", action="store_true", default=d, help=VERBOSE_HELP)
    p.set_defaults(func=_cmd_demo)


def _cmd_demo(args: argparse.Namespace) -> int:
    engine_environment(getattr(args, "verbose", False))
    from rich.console import Console

    from inferscale.demo import DemoConfig, run_demo

    from inferscale.config import EngineSettings

    options = {k: v for k, v in vars(args).items() if k not in ("command", "func", "verbose")}
    settings = {f: options.pop(f) for f in EngineSettings.__dataclass_fields__ if f in options}  # serve's flags
    cfg = DemoConfig(**options, settings=EngineSettings(**settings))
    if cfg.engine == "jax":
        run_demo(cfg, Console())
    else:
        from inferscale.chat_demo import run_chat_demo

        run_chat_demo(cfg, Console())
    return 0


def _user_errors() -> tuple[type[BaseException], ...]:
    from inferscale.common.storage.format import StoreError

    return (ValueError, KeyError, FileNotFoundError, StoreError)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    user_errors = _user_errors()
    try:
        return args.func(args)
    except user_errors as e:
        print(f"error: {e.args[0] if isinstance(e, KeyError) and e.args else e}", file=sys.stderr)
        return USAGE_ERROR
    except KeyboardInterrupt:
        print("interrupted", file=sys.stderr)
        return INTERRUPTED


if __name__ == "__main__":
    sys.exit(main())
