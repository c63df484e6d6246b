"""Command line: parse flags, build the config, call train / translate / eval / bench / export.

Flags are generated from the config dataclasses (see ``configbase.add_args``), so defaults,
validation, YAML keys and flags have one source. Errors the user can fix print one line and exit
non-zero (2 for a bad flag or config value, 1 for a bad input file); no traceback.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Callable, Sequence

from streamnmt.configbase import add_args, from_dict
from streamnmt.dist import CaptureFailed, PeerLost
from streamnmt.errors import ConfigError, DeviceError, InputError, NonFiniteLoss


def _train(args: dict) -> int:
    from streamnmt import dist

    config_file = args.pop("config", None)
    nproc = args.pop("nproc", None)
    if nproc is not None:
        return _exec_torchrun(nproc, args, config_file)
    resume = args.pop("resume", None)
    try:
        return _run_trainer(args, config_file, resume)
    except Exception as e:
        d = dist.Dist(*dist.world_from_env()[:2], backend="env" if "WORLD_SIZE" in os.environ else None)
        if d.active and dist.is_collective_error(e):
            raise dist.peer_lost(d, e) from None
        raise


def _run_trainer(args: dict, config_file: str | None, resume: str | None) -> int:
    from streamnmt.config import RESUME_SETTINGS, build_job
    from streamnmt.training.trainer import Trainer

    if resume is not None:
        extra = sorted(set(args) - {"device", *RESUME_SETTINGS})
        if extra or config_file:
            raise ConfigError(f"--resume continues a run with the settings in its checkpoint (it takes new "
                              f"--device and limits only: {', '.join('--' + k.replace('_', '-') for k in RESUME_SETTINGS)}"
                              f"); drop {', '.join('--' + k.replace('_', '-') for k in extra) or '--config'}")
        trainer = Trainer.from_checkpoint(resume, device=args.get("device"),
                                          changes={k: args[k] for k in RESUME_SETTINGS if k in args})
    else:
        trainer = Trainer(build_job(args, config_file))
    result = trainer.train()
    trainer.dist.close()
    if not result["stopped"] and trainer.dist.main:
        print(f"done: {result['steps']} steps, best val_loss {result['best_val']:.4f}; "
              f"results in {result['save_dir']}")
    return 0


def _exec_torchrun(nproc: str, args: dict, config_file: str | None) -> int:
    """``streamnmt train --nproc N``: check the flags, then run torchrun (``torch.distributed.run``'s
    own entry point, ``--standalone``) in this process, which starts N trainer processes. A stop
    by SIGTERM/SIGINT, which torchrun forwards to the ranks (they finish the step, rank 0 saves),
    exits 0; a failed rank exits non-zero with one line naming it."""
    import torch

    from streamnmt import dist
    from streamnmt.config import build_job
    from streamnmt.configbase import check

    try:
        n = int(nproc)
    except ValueError:
        raise ConfigError(f"--nproc: must be an integer; got {nproc!r}") from None
    check(n >= 1, "nproc", f"must be at least 1; got {n}")
    check(int(os.environ.get("WORLD_SIZE", "1")) <= 1, "nproc", "this process already runs under torchrun; drop --nproc")
    if args.get("resume") is None:
        job = build_job({k: v for k, v in args.items()}, config_file)  # bad flags: exit 2 before starting
        device, backend = job.run.device, job.engine.dist_backend
    else:
        device, backend = args.get("device"), args.get("dist_backend", "auto")
    cuda = device.startswith("cuda") if device else torch.cuda.is_available()
    check(backend != "nccl" or cuda, "dist_backend", "nccl needs CUDA devices but the run is on the CPU; "
                                                     "use --dist-backend gloo or auto")
    if cuda:
        check(n <= torch.cuda.device_count(), "nproc",
              f"{n} processes but only {torch.cuda.device_count()} CUDA device(s); one GPU per process")
    argv = _argv_without_nproc(sys.argv[1:] if _ARGV is None else list(_ARGV))
    return dist.run_torchrun(n, ["-m", "streamnmt", *argv])


def _argv_without_nproc(argv: list[str]) -> list[str]:
    out, skip = [], False
    for a in argv:
        if skip:
            skip = False
        elif a == "--nproc":
            skip = True
        elif not a.startswith("--nproc="):
            out.append(a)
    return out


_ARGV: Sequence[str] | None = None  # main()'s argv, for --nproc's re-exec


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
    p.add_argument("--nproc", default=argparse.SUPPRESS, metavar="N",
                   help="train on N processes of this host (one per GPU): starts torchrun for you")
    for name, cls in SECTIONS.items():
        add_args(p.add_argument_group(name), cls)
    p.set_defaults(_run=_train)
    for command, module, cfg_name, fn_name, help_text in (
            ("translate", "inference.translate", "TranslateConfig", "run_translate", "translate lines of text"),
            ("eval", "inference.translate", "EvalConfig", "run_eval", "BLEU and chrF of a checkpoint on a split"),
            ("bench", "bench", "BenchConfig", "run_bench", "benchmark the sync strategies side by side"),
            ("average", "inference.average", "AverageConfig", "run_average", "average the weights of checkpoints"),
            ("export", "inference.export", "ExportConfig", "run_export", "write a checkpoint as a CTranslate2 model")):
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
    global _ARGV
    _ARGV = argv
    parser = build_parser()
    args = vars(parser.parse_args(argv))
    run = args.pop("_run")
    args.pop("command")
    try:
        return run(args)
    except (ConfigError, InputError, NonFiniteLoss, DeviceError, PeerLost, CaptureFailed) as e:
        if int(os.environ.get("RANK", "0")) == 0 or isinstance(e, PeerLost):  # the same line on every rank
            print(f"streamnmt: error: {e}", file=sys.stderr)
        if isinstance(e, PeerLost) and "WORLD_SIZE" in os.environ:  # a collective whose peer died may never
            # finish: no teardown (process group, CUDA context) is left to wait for it
            sys.stdout.flush()
            sys.stderr.flush()
            os._exit(e.exit_code)
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
