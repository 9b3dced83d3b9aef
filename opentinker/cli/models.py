"""`opentinker models …`: the registry from the command line (list, evaluate, promote, delete).

Talks to the stack's MLflow server (settings: OPENTINKER_MLFLOW_PORT, …). `evaluate` runs the
same evaluation as the `evaluate-promote` deployment, in this process.
"""

from __future__ import annotations

from typing import Optional

import typer
from rich.console import Console
from rich.markup import escape
from rich.table import Table

from opentinker.eval.promotion import DEFAULTS

models_app = typer.Typer(help="Registered models: versions, aliases, evaluation, promotion and deletion.", no_args_is_help=True)
console = Console()


def _fail(err: Exception) -> None:
    console.print(f"[red]{escape(str(err))}[/]", highlight=False, soft_wrap=True)
    raise typer.Exit(1)


@models_app.command("list")
def list_models(name: Optional[str] = typer.Argument(None, help="one model: list its versions")) -> None:
    """Registered models and their aliases, or one model's versions with lineage and verdicts."""
    from mlflow.exceptions import MlflowException

    from opentinker.storage.registry import is_missing, registry_client

    try:
        client = registry_client()
        if name is None:
            table = Table("model", "champion", "challenger", "versions")
            for m in client.search_registered_models(max_results=1000):
                n = len(client.search_model_versions(f"name = '{m.name}'"))
                table.add_row(m.name, str(m.aliases.get("champion", "-")), str(m.aliases.get("challenger", "-")), str(n))
            console.print(table)
            return
        aliases = client.get_registered_model(name).aliases
    except MlflowException as err:
        _fail(LookupError(f"no registered model {name!r}") if is_missing(err) else err)
    except ConnectionError as err:
        _fail(err)
    table = Table("version", "aliases", "job", "environment", "decision", "checkpoint")
    for v in sorted(client.search_model_versions(f"name = '{name}'"), key=lambda v: int(v.version)):
        on = ", ".join(a for a, ver in sorted(aliases.items()) if str(ver) == str(v.version))
        table.add_row(str(v.version), on, v.tags.get("job_id", ""), v.tags.get("environment", ""),
                      v.tags.get("promotion.decision", ""), v.tags.get("checkpoint_url", ""))
    console.print(table)


@models_app.command()
def evaluate(
    name: str = typer.Argument(..., help="registered model"),
    n_samples: Optional[int] = typer.Option(None, help="validation problems (default: the job's evaluation.n_samples)"),
    margin: float = typer.Option(DEFAULTS["margin"], help="minimum mean reward improvement to promote"),
    alpha: float = typer.Option(DEFAULTS["alpha"], help="significance level of the one-sided sign test"),
    min_samples: int = typer.Option(DEFAULTS["min_samples"], help="fewer paired problems never promote"),
    engine: str = typer.Option("auto", help="auto (vllm where it runs the model and the evaluation is large enough to repay "
                               "its start-up, else hf), hf or vllm"),
) -> None:
    """Evaluate the challenger against the champion now and move `champion` if it wins."""
    import os
    import warnings

    os.environ.setdefault("MLFLOW_SUPPRESS_PRINTING_URL_TO_STDOUT", "true")  # we print the audit run below
    os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
    warnings.filterwarnings("ignore", category=FutureWarning)
    from transformers.utils import logging as hf_logging

    hf_logging.set_verbosity_error()
    hf_logging.disable_progress_bar()
    from functools import partial

    from opentinker.eval.promotion import evaluate_and_promote
    from opentinker.core.settings import get_settings
    from opentinker.inference.evaluation import evaluate as evaluate_on

    try:
        with console.status(f"evaluating {name}: challenger vs champion"):
            record = evaluate_and_promote(name, n_samples=n_samples, margin=margin, alpha=alpha, min_samples=min_samples,
                                          evaluate=partial(evaluate_on, engine=engine))
    except (LookupError, ValueError, ConnectionError, FileNotFoundError) as err:
        _fail(err)
    if "challenger_mean" in record:
        console.print(f"v{record['challenger']} {record['challenger_mean']:.3f} vs champion v{record['champion_before']} "
                      f"{record['champion_mean']:.3f} (n={record['n']}, p={record['p_value']:.3g})")
    console.print(f"[bold]{record['decision']}[/]: {escape(record['reason'])}", soft_wrap=True)
    if record.get("eval_run_id"):
        console.print(f"audit record: {get_settings().mlflow_url}/#/experiments/{record['experiment_id']}/runs/{record['eval_run_id']}", soft_wrap=True)


@models_app.command()
def promote(name: str = typer.Argument(..., help="registered model"), version: str = typer.Argument(..., help="version to make champion")) -> None:
    """Move `champion` to a version by hand (recorded on the version as a manual promotion)."""
    from opentinker.eval.promotion import promote_manually

    try:
        record = promote_manually(name, version)
    except (LookupError, ConnectionError) as err:
        _fail(err)
    console.print(f"{name}: champion v{record['champion_before'] or '-'} → v{record['champion_after']}")


@models_app.command()
def delete(name: str = typer.Argument(..., help="registered model"), version: str = typer.Argument(..., help="version to delete")) -> None:
    """Delete one version, its aliases with it; the checkpoint it names stays in storage (its owner may
    then delete it: a checkpoint a version uses is not deleted)."""
    from mlflow.exceptions import MlflowException

    from opentinker.storage.registry import CHECKPOINT_TAG, get_version, registry_client

    try:
        client = registry_client()
        mv = get_version(client, name, version=version)
        on = sorted(a for a, v in client.get_registered_model(name).aliases.items() if str(v) == str(mv.version))
        client.delete_model_version(name, mv.version)
    except (LookupError, ConnectionError, MlflowException) as err:
        _fail(err)
    aliases = f" and its aliases ({', '.join(on)})" if on else ""
    console.print(f"{name}: version {mv.version}{aliases} deleted; its checkpoint stays: {mv.tags.get(CHECKPOINT_TAG, '-')}", soft_wrap=True)
