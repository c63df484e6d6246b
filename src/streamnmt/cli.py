"""Command line: parse flags, build the config, call train / translate / eval / bench / export.

Flags are generated from the config dataclasses (see ``configbase.add_args``), so defaults,
validation, YAML keys and flags have one source. Errors the user can fix print one line and exit
non-zero (2 for a bad flag or config value, 1 for a bad input file); no traceback.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Sequence

from streamnmt.configbase import add_args, from_dict
from streamnmt.errors import ConfigError, InputError, NonFiniteLoss


def _train(args: dict) -> int:
    from streamnmt.config import build_job
    from streamnmt.train import Trainer

    config_file = args.pop("config", None)
    resume = args.pop("resume", None)
    if resume is not None:
        extra = sorted(set(args) - {"device"})
        if extra or config_file:
            raise ConfigError(f"--resume continues a run with the settings in its checkpoint; drop "
                              f"{', '.join('--' + k.replace('_', '-') for k in extra) or '--config'}")
        trainer = Trainer.from_checkpoint(resume, device=args.get("device"))
    else:
        trainer = Trainer(build_job(args, config_file))
    result = trainer.train()
    if not result["stopped"]:
        print(f"done: {result['steps']} steps, best val_loss {result['best_val']:.4f}; "
              f"results in {result['save_dir']}")
    return 0


def _sub(module: str, cfg_name: str, fn_name: str) -> Callable[[dict], int]:
    def run(args: dict) -> int:
        mod = __import__(f"streamnmt.{module}", fromlist=[cfg_name, fn_name])
        return getattr(mod, fn_name)(from_dict(getattr(mod, cfg_name), args))
    return run


def build_parser() -> argparse.ArgumentParser:
    from streamnmt.config import SECTIONS

    parser = argparse.ArgumentParser(prog="streamnmt", description="Transformer NMT training that keeps the GPU busy")
    sub = parser.add_subparsers(dest="command", required=True)
    p = sub.add_parser("train", help="train a model (built-in English->Chinese corpus without --data)")
    p.add_argument("--config", default=argparse.SUPPRESS, help="YAML config file; flags override it")
    for name, cls in SECTIONS.items():
        add_args(p.add_argument_group(name), cls)
    p.set_defaults(_run=_train)
    for command, module, cfg_name, fn_name, help_text in (
            ("translate", "translate", "TranslateConfig", "run_translate", "translate lines of text"),
            ("eval", "translate", "EvalConfig", "run_eval", "BLEU and chrF of a checkpoint on a split"),
            ("bench", "bench", "BenchConfig", "run_bench", "benchmark the sync strategies side by side"),
            ("export", "export", "ExportConfig", "run_export", "write a checkpoint as a CTranslate2 model")):
        try:
            mod = __import__(f"streamnmt.{module}", fromlist=[cfg_name])
            cls = getattr(mod, cfg_name)
        except (ImportError, AttributeError):
            continue  # a command whose module is not installed is not offered
        p = sub.add_parser(command, help=help_text)
        add_args(p, cls)
        p.set_defaults(_run=_sub(module, cfg_name, fn_name))
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    run = args.pop("_run")
    args.pop("command")
    try:
        return run(args)
    except (ConfigError, InputError, NonFiniteLoss) as e:
        print(f"streamnmt: error: {e}", file=sys.stderr)
        return e.exit_code
    except OSError as e:  # e.g. a run directory that cannot be written, a full disk
        where = f" ({e.filename})" if getattr(e, "filename", None) else ""
        print(f"streamnmt: error: {e.strerror or e}{where}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("streamnmt: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
