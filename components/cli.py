"""The ``posttrain`` command.

    posttrain stage <id> --recipe R --run-root URI --iteration K [--shard i/n]
    posttrain run --iterations N [--recipe R] [--run-root URI]
    posttrain kfp-local --iterations N [--recipe R] [--run-root URI]
    posttrain sandbox run [--lang python|bash] [--timeout S] [--memory MB] FILE
    posttrain serve --checkpoint URI [--host H] [--port P]
    posttrain verify --domain D --task FILE --completion FILE|-
    posttrain replay --iteration K --recipe OTHER.yaml [--run-root URI]
    posttrain render pytorchjob --nodes N --iteration K [--recipe R] [--run-root URI] [--publish]

A user's mistake ends with one line on stderr naming the field, the value and the fix,
and exit status 2; an unreachable store, tracking server or inference endpoint (or an
iteration another run holds) exits 1 and is worth retrying; a failed data-quality gate
exits 3. ``render pytorchjob`` prints, as YAML, the Kubeflow ``PyTorchJob`` that runs the
trainer stage of iteration K on N nodes (``dags/execution/pytorchjob.py``; the pods read
the recipe from the run root, where ``--publish`` puts a local one; with N > 1 a local
run root is refused: the nodes' pods cannot share it). ``release`` refuses an iteration
that has finished (nothing holds it any more) or is out of range. An argument no parser
knows is named with the help of the subcommand it followed. ``stage``, ``run``
and ``kfp-local`` stop on SIGTERM (a container or pod being stopped, ``kill``) and on
Ctrl-C (SIGINT): the running stage's MLflow run ends KILLED, and the
command exits 143 (130 for Ctrl-C) with one line saying so. Ctrl-C on any other command
is one line (``posttrain: interrupted (Ctrl-C)``) and exit 130, never a traceback.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import shlex
import signal
import sys
from typing import TYPE_CHECKING, NoReturn

from components import startup  # first: Ctrl-C during the imports below is one line, not a traceback
from components.core import gcpolicy, settings
from components.core.errors import EXIT_INFRA_ERROR, EXIT_USER_ERROR, DataQualityError, InfraError, UserError, one_line
from components.core.lease import LeaseHeld
from components.core.stages import stage_ids
from components.core.tracking import Terminated
from components.domains.cli import add_parser as add_verify
from components.reward.replay import add_parser as add_replay
from components.rollout.cli import add_parser as add_serve
from components.sandbox.cli import add_parser as add_sandbox

if TYPE_CHECKING:
    from components.core.storage import Store

startup.done()


class _Parser(argparse.ArgumentParser):
    """argparse's parser, whose mistakes (a missing flag, ``--iterations abc``) are one line
    and exit 2 like every other, the fix pointing at the command's ``--help``, instead of
    the usage block and then the message."""

    def error(self, message: str) -> NoReturn:
        self.exit(EXIT_USER_ERROR, f"{self.prog}: error: {one_line(message)}; fix: see '{self.prog} --help'\n")


def _common(p: argparse.ArgumentParser) -> None:
    p.add_argument("--recipe", default=None, help="recipe YAML (default: $POSTTRAIN_RECIPE or recipes/demo.yaml)")
    p.add_argument("--run-root", default=None,
                   help="store URI, file://... or s3://... (default: $POSTTRAIN_RUN_ROOT or $POSTTRAIN_HOME/store)")


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="posttrain", description="RL post-training as recurring, lineage-tracked pipeline runs.")
    sub = parser.add_subparsers(dest="command", required=True)

    stage = sub.add_parser("stage", help="run one stage of one iteration")
    stage.add_argument("stage_id", choices=stage_ids(), metavar="stage", help=f"one of {', '.join(stage_ids())}")
    _common(stage)
    stage.add_argument("--iteration", type=int, default=1, help="iteration k (bootstrap ignores it)")
    stage.add_argument("--shard", default=None, help="i/n for rollout, sandbox and reward")
    stage.add_argument("--orchestrator-run-id", default="",
                       help="the orchestrator's run id (an Airflow run id): the stage's MLflow run nests under that run's iteration run")
    stage.add_argument("--lease-holder", default="",
                       help="the holder of the iteration's lease (the orchestrator's plan passes it): renewed while the stage runs")

    run = sub.add_parser("run", help="run iterations of the Airflow DAG on the embedded defaults")
    _common(run)
    run.add_argument("--iterations", type=int, default=3, help="bring the pipeline to this many finished iterations (default: %(default)s)")

    kfp = sub.add_parser("kfp-local", help="run iterations of the Kubeflow pipeline on this machine (kfp.local)")
    _common(kfp)
    kfp.add_argument("--iterations", type=int, default=1, help="bring the pipeline to this many finished iterations (default: %(default)s)")
    kfp.set_defaults(handler=_kfp_local)

    for add in (add_sandbox, add_serve, add_verify, add_replay):  # sandbox, serve, verify, replay
        add(sub)

    free = sub.add_parser("release", help="hand back the lease of a run that is gone (killed, or marked failed in the "
                                          "orchestrator's UI), so the next run can take its iteration at once")
    _common(free)
    free.add_argument("--iteration", type=int, required=True, help="the iteration whose lease to hand back")
    free.add_argument("--holder", required=True,
                      help="the holder the lease names (as the 'busy' line prints it): nothing else is released")
    free.set_defaults(handler=_release)

    render = sub.add_parser("render", help="print a cluster spec for a stage, without a cluster")
    kinds = render.add_subparsers(dest="kind", required=True)
    job = kinds.add_parser("pytorchjob", help="the trainer stage of one iteration as a Kubeflow PyTorchJob (YAML on stdout)")
    _common(job)
    job.add_argument("--nodes", type=int, required=True, help="nodes, each running trainer.processes processes")
    job.add_argument("--iteration", type=int, required=True, help="iteration k whose trainer stage the job runs")
    job.add_argument("--publish", action="store_true",
                     help="copy a local recipe into the run root, where the pods read it (as the DAG's plan task does)")
    job.set_defaults(handler=_render_pytorchjob)
    _known_to_themselves(parser)
    return parser


def _known_to_themselves(parser: argparse.ArgumentParser) -> None:
    """Each subcommand's parser as ``args.command_parser``, the innermost one given: an
    unknown flag is reported by the command it was given to (``posttrain run --help`` lists
    run's flags; ``posttrain --help`` does not)."""
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            for child in action.choices.values():
                child.set_defaults(command_parser=child)
                _known_to_themselves(child)


def parse(argv: list[str]) -> argparse.Namespace:
    """``argv`` parsed; a mistake argparse finds is one line and exit 2, an unknown argument
    named with the help of the subcommand it followed."""
    parser = build_parser()
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        getattr(args, "command_parser", parser).error(f"unrecognized arguments: {' '.join(unknown)}")
    return args


MAX_ORCHESTRATOR_RUN_ID = 1000  # Airflow's run ids stop at 250 characters, Kubeflow's are UUIDs


def _check_orchestrator_run_id(value: str, flag: str = "--orchestrator-run-id",
                               fix: str = "pass the orchestrator's run id (Airflow's run_id, a Kubeflow run's UUID), "
                                          "or leave the flag out") -> None:
    """``--orchestrator-run-id`` goes into an MLflow tag and the stage's lineage: text a
    log and a database can hold (a control character, bytes that are not UTF-8 or a
    longer text was a traceback from MLflow, or a tag no one could read). The same for
    ``--lease-holder``, which goes into a lease record."""
    from components.core.storage import unusable_text

    problem = unusable_text(value)
    if problem is not None:
        problem = (problem[0], fix)  # its own fix: a run id is no path
    elif value and not value.strip():
        problem = ("is blank", fix)
    elif len(value) > MAX_ORCHESTRATOR_RUN_ID:
        problem = (f"is {len(value)} characters long, more than {MAX_ORCHESTRATOR_RUN_ID}", fix)
    if problem is not None:
        raise UserError(flag, value, *problem)


def _stage(args: argparse.Namespace) -> int:
    from components.core.runner import run_stage

    conf = settings.resolve(args.recipe, args.run_root)
    _check_orchestrator_run_id(args.orchestrator_run_id)
    _check_orchestrator_run_id(args.lease_holder, "--lease-holder",
                               "pass the holder the orchestrator's plan leased the iteration to, or leave the flag out")
    settings.torch_threads()  # a bad POSTTRAIN_TORCH_THREADS stops here, before the stage writes anything
    settings.gc_policy()  # and a bad POSTTRAIN_GC
    if args.lease_holder and args.stage_id != "bootstrap":  # a DAG's stage container: still its run's iteration
        from components.core import planner
        from components.core.recipe import load_recipe

        pipeline = load_recipe(conf.recipe).pipeline
        with _reachable_store(conf.run_root) as store:
            planner.check_current(store, pipeline, args.iteration, args.lease_holder)
    with _lease_renewed(args, conf):
        run_stage(args.stage_id, conf.recipe, conf.run_root, args.iteration, args.shard,
                  orchestrator_run_id=args.orchestrator_run_id, in_order=True)
    return 0


def _lease_renewed(args: argparse.Namespace, conf):
    """With ``--lease-holder`` (a stage container or pod of the DAG), the iteration's lease
    is renewed while the stage runs: one stage may outlive its 6 hours (the trainer's limit
    is as long). Bootstrap runs before any iteration is leased: nothing to renew."""
    import contextlib

    if not args.lease_holder or args.stage_id == "bootstrap":
        return contextlib.nullcontext()
    from components.core import lease
    from components.core.recipe import load_recipe
    from components.core.storage import Store

    return lease.renewed(Store(conf.run_root, "--run-root"), load_recipe(conf.recipe).pipeline, args.iteration,
                         args.lease_holder)


def _run(args: argparse.Namespace) -> int:
    from dags.orchestrate import run_local

    return run_local(args.recipe, args.run_root, args.iterations, stage_host=args.process_entry)


def _kfp_local(args: argparse.Namespace) -> int:
    from dags.orchestrate import run_local
    from pipelines import local

    return run_local(args.recipe, args.run_root, args.iterations, driver=local)


def _release(args: argparse.Namespace) -> int:
    """Release ``--holder``'s lease on ``--iteration``: for a run that is gone without
    handing it back (a DAG run marked failed in the UI skips its failure callback, a pod
    killed with its node). Only the named holder's lease goes, so a run that took the
    iteration since is never cut off; its run must really be stopped (this does not stop it)."""
    from components.core.manifest import check_not_past_max
    from components.core.recipe import load_recipe

    if args.iteration < 1:
        raise UserError("--iteration", args.iteration, "iterations count from 1", "pass --iteration 1 or higher")
    check_not_past_max("--iteration", args.iteration)
    conf = settings.resolve(args.recipe, args.run_root)
    pipeline = load_recipe(conf.recipe).pipeline
    with _reachable_store(conf.run_root) as store:
        _release_lease(store, pipeline, args.iteration, args.holder)
    return 0


def _release_lease(store: Store, pipeline: str, iteration: int, holder: str) -> None:
    """``_release``'s work on a store that answers: a finished iteration, one no lease
    holds and one another holder holds are refused; else ``holder``'s lease is handed back."""
    import time

    from components.core import lease
    from components.core.manifest import MANIFEST, stage_prefix

    if store.exists(f"{stage_prefix(pipeline, iteration, 'evaluation')}/{MANIFEST}"):  # planner.finished's test
        raise UserError("--iteration", iteration, f"iteration {iteration} of pipeline {pipeline!r} under "
                        f"{store.uri} has finished (its evaluation manifest exists), so no run works on it and there "
                        "is nothing to release", "nothing to do: the next run plans the iteration after the last "
                        "finished one")
    cur = lease.current(store, pipeline, iteration)
    if cur is None or not cur.holder:
        raise UserError("--iteration", iteration, f"iteration {iteration} of pipeline {pipeline!r} under "
                        f"{store.uri} has no lease to release ({'none was taken' if cur is None else 'released already'})",
                        "nothing to do: the next run can take it")
    if cur.holder != holder:
        raise UserError("--holder", holder, f"iteration {iteration} of pipeline {pipeline!r} is held by "
                        f"{cur.holder!r}, not by this holder", f"pass --holder {shlex.quote(cur.holder)} if that run "
                        "is gone, or leave it to finish")
    if not lease.release(store, pipeline, iteration, holder):  # taken over between the read and the write
        raise UserError("--holder", holder, f"the lease on iteration {iteration} changed hands while being "
                        "released", "run the command again to see who holds it now")
    left = max(0.0, cur.expires_at - time.time())
    print(f"released iteration {iteration} of {pipeline!r} (held by {holder!r}, {left:.0f} s before it "
          "would have expired)")


def _reachable_store(run_root: str) -> contextlib.AbstractContextManager[Store]:
    """``storage.reachable_store`` for ``--run-root``: wrong keys, a missing bucket or a
    folder that cannot be written are one UserError (exit 2), a store that does not answer,
    before or inside the body, one InfraError (exit 1, retried); never a traceback."""
    from components.core.storage import reachable_store

    return reachable_store(run_root, "--run-root")


def _render_pytorchjob(args: argparse.Namespace) -> int:
    import contextlib
    import warnings

    import yaml

    from components.core.recipe import load_recipe, publish_recipe

    # stdout carries the YAML alone (it is piped to kubectl): anything else written while
    # rendering (a provider's import-time log line, a store client's notice) goes to stderr.
    with contextlib.redirect_stdout(sys.stderr):
        with warnings.catch_warnings():  # the Kubernetes provider's imports warn about Airflow's own renames
            warnings.simplefilter("ignore")
            from dags.execution import pytorchjob

        conf = settings.resolve(args.recipe, args.run_root)
        recipe = load_recipe(conf.recipe)
        uri = pytorchjob.recipe_uri(conf.recipe, conf.run_root)
        job = pytorchjob.render(recipe, uri, conf.run_root, args.iteration, args.nodes)
        if args.nodes > 1 and conf.run_root.startswith("file://"):  # as the docker mode refuses one (docker.check_run_root)
            raise UserError("--run-root", conf.run_root, f"the {args.nodes} nodes' pods each have a file system of "
                            "their own, so the trainer's replicas on them cannot share a local run root",
                            "give an s3:// run root (POSTTRAIN_RUN_ROOT or --run-root), or render the job with --nodes 1")
        if args.publish:
            from components.core.storage import Store

            Store(conf.run_root, "--run-root").check_reachable()  # an outage or a refusal as one line, not a traceback
            published = publish_recipe(conf.recipe, conf.run_root)
            assert published == uri, (published, uri)
        elif uri != conf.recipe:
            print(f"posttrain: the pods read the recipe from {uri}; add --publish to copy it there", file=sys.stderr)
        text = yaml.safe_dump(job, sort_keys=False)
    sys.stdout.write(text)
    return 0


def exit_terminated() -> int:
    """A shell's status for a process ended by the signal that stopped it (143 for SIGTERM, 130 for SIGINT)."""
    from components.core import runner

    return 128 + int(runner.stop_signal())


def main(argv: list[str] | None = None) -> int:
    """The command; ``argv=None`` is the process's own entry (the console script, ``python
    -m components.cli``), where ``stage`` and ``run`` also run ``gcpolicy``'s collector policy."""
    policy = False
    try:
        try:  # the parser lists the registered stages: a broken stage plug-in is one line here, --help too
            args = parse(_joined_negative_shard(sys.argv[1:] if argv is None else argv))
        except UserError as exc:
            print(f"posttrain: error: {exc.line()}", file=sys.stderr)
            return EXIT_USER_ERROR
        for name in ("botocore.credentials", "aiobotocore.credentials"):  # "Found credentials in ...": said at info
            logging.getLogger(name).setLevel(logging.WARNING)               # level on every S3 client, by no one's wish
        handlers = {"stage": _stage, "run": _run, "kfp-local": _kfp_local}  # the commands SIGTERM stops as one
        policy = argv is None and args.command in ("stage", "run")  # the commands that run stages in this process
        args.process_entry = argv is None  # the process is this command: it may fork a stage host (``posttrain run``)
        if policy:
            gcpolicy.start()
        return _dispatch(args, handlers)
    except KeyboardInterrupt:  # Ctrl-C on a command without a stop handler (sandbox, replay, serve, ...)
        print("posttrain: interrupted (Ctrl-C)", file=sys.stderr)
        return 128 + int(signal.SIGINT)
    finally:
        if policy:
            gcpolicy.before_exit()


def _joined_negative_shard(argv: list[str]) -> list[str]:
    """``--shard -1/2`` as ``--shard=-1/2``: argparse takes a value that starts with ``-``
    and is not a plain negative number for an option, and said "expected one argument"
    without the value; joined, ``Shard.parse`` names it and the range."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] == "--shard" and i + 1 < len(argv) and argv[i + 1][:1] == "-" and argv[i + 1][1:2].isdigit():
            out.append(f"--shard={argv[i + 1]}")
            i += 2
        else:
            out.append(argv[i])
            i += 1
    return out


def _named_as_set(exc: UserError, args: argparse.Namespace) -> UserError:
    """``exc`` naming ``POSTTRAIN_RUN_ROOT`` or ``POSTTRAIN_RECIPE`` where it names
    ``--run-root`` or ``--recipe`` and the value came from that variable (the user typed
    no such flag)."""
    if exc.field not in settings.FLAG_VARIABLES:
        return exc
    attr, variable = settings.FLAG_VARIABLES[exc.field]
    if getattr(args, attr, None) is not None or not os.environ.get(variable):
        return exc
    return UserError(variable, exc.value, exc.problem, exc.fix)


EMPTY_REFUSED = ("recipe", "run_root", "backend")  # flags whose "" would quietly be their default


def _refuse_empty_flags(args: argparse.Namespace) -> None:
    """``--recipe ""`` (an unset variable in a script) was the demo recipe and ``--run-root
    ""`` the home's store, with no word said; a flag given is a value asked for."""
    for name in EMPTY_REFUSED:
        value = getattr(args, name, None)
        if value is not None and not value.strip():
            flag = "--" + name.replace("_", "-")
            raise UserError(flag, value, "is empty", f"pass a value, or leave {flag} out for its default")


def _dispatch(args: argparse.Namespace, handlers: dict) -> int:
    try:
        _refuse_empty_flags(args)
        if args.command in handlers:
            from components.core import runner

            # SIGTERM (and Ctrl-C, when this command is the process) raises tracking.Terminated:
            # the stage's run ends KILLED and the command stops. Called as a function (a test,
            # a script), the caller's handlers are put back when it returns.
            with contextlib.nullcontext() if args.process_entry else runner.handlers_put_back():
                runner.stop_on_sigterm(sigint=args.process_entry)
                code = handlers[args.command](args)
            if runner.stopping():
                print(f"posttrain: stopped by {runner.stop_signal().name}; run the same command again to resume",
                      file=sys.stderr)
                return exit_terminated()
            return code
        return args.handler(args)
    except UserError as exc:
        print(f"posttrain: error: {_named_as_set(exc, args).line()}", file=sys.stderr)
        return EXIT_USER_ERROR
    except DataQualityError as exc:
        print(f"posttrain: {exc}", file=sys.stderr)
        return exc.exit_code
    except InfraError as exc:  # an outage, not the user's mistake: the same command works once it is back
        print(f"posttrain: unreachable: {exc.line()}", file=sys.stderr)
        return EXIT_INFRA_ERROR
    except LeaseHeld as exc:
        print(f"posttrain: busy: {exc}", file=sys.stderr)
        return EXIT_INFRA_ERROR
    except Terminated as exc:  # SIGTERM outside a stage (a stage's own run already ended KILLED)
        print(f"posttrain: {exc}; run the same command again to resume", file=sys.stderr)
        return exit_terminated()


if __name__ == "__main__":
    sys.exit(main())
