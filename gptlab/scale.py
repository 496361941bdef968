"""python -m gptlab.scale SOURCE [scale.*=...]: fit scaling laws, predict a compute-optimal run.

The laws are fitted to (FLOPs, parameters, tokens, loss) points; the run predicted is the
compute-optimal one for a budget.

SOURCE is a CSV with the columns flops, params, tokens and loss (from a study, a paper's table,
anywhere), or a folder whose run folders hold results.json (params, tokens, best_val_loss) and
derived.json (flops_per_token). It prints one table, and writes scaling.json and scaling.png
beside the source (or into scale.out). The methods: docs/scaling.md.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Dict, List, Optional

from hydra.core.config_store import ConfigStore

from gptlab.cli import text_keys
from gptlab.errors import GptlabError

log = logging.getLogger("gptlab.scale")


@dataclass
class ScaleSettings:
    """The command's own keys (values in conf/scale.yaml)."""

    source: str  # a CSV of flops,params,tokens,loss rows, or a folder of run folders
    target_flops: Optional[float]  # predict the compute-optimal run for this budget; null: none
    bootstrap: int  # resamplings for the 95% intervals (0: none)
    seed: int  # the resampling's seed
    out: Optional[str]  # the folder for scaling.json and scaling.png; null: beside the source
    verify: bool  # train the predicted compute-optimal run at target_flops (a study's folder)


@dataclass
class ScaleConfig:
    scale: ScaleSettings


ConfigStore.instance().store(name="gptlab_scale_schema", node=ScaleConfig)
POSITIONAL = "scale.source"  # python -m gptlab.scale SOURCE is scale.source=SOURCE
TEXT_KEYS = text_keys(ScaleSettings, "scale.")


def run_scale(cfg: Any) -> Dict[str, Any]:
    from gptlab.config import to_config
    from gptlab.scaling import study
    from gptlab.scaling.fit import read_csv
    from gptlab.scaling.report import fit_all, read_runs, table, write_fit

    s = to_config(cfg, ScaleConfig).scale
    source = Path(s.source).expanduser()
    held = study.read_study(source) if source.is_dir() else None
    if s.verify and not (held and s.target_flops):
        raise GptlabError(
            "scale.verify=true trains the predicted run of a study: give a study's folder (made by "
            "-m scaling=...) and scale.target_flops"
        )
    objective = (held or {}).get("scaling", {}).get("objective", "best_val_loss")
    if source.is_dir():
        points, out = read_runs(source, objective), Path(s.out or source)
    elif source.is_file():
        points, out = read_csv(source), Path(s.out or source.parent)
    else:
        raise GptlabError(f"scale.source={s.source}: no such CSV file or folder")
    result = fit_all(points, s.bootstrap, s.seed, s.target_flops)
    if held and result.get("target"):
        study.nearest_run(held, result["target"])
        if s.verify:
            study.verify(source, result["target"], objective)
    print(table(result))
    write_fit(result, points, out)
    print(f"wrote {out / 'scaling.json'} and {out / 'scaling.png'}")
    return result


def main(argv: Optional[List[str]] = None) -> Optional[Dict[str, Any]]:
    """python -m gptlab.scale SOURCE: a Hydra app on conf/scale.yaml that writes scaling.json."""
    from gptlab.cli import command

    return command("scale", run_scale, argv)


if __name__ == "__main__":
    main()
