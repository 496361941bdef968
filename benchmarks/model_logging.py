"""What tracking.log_model adds to the end of a run: the logged model's size and its seconds.

    python benchmarks/model_logging.py --model gpt2_124m --vocab 50257
    python benchmarks/model_logging.py --model gpt_char

A run folder is made with one checkpoint of the model (random weights, with AdamW's state as a run
saves it) and an MLflow run in a fresh SQLite store; then the same call the end of a run makes
(serving.log_checkpoint) is timed, twice. --vocab sets the vocabulary (GPT-2's 50,257 needs
tiktoken's files to train on, which a machine offline lacks; the weights' size is what matters, and
the tokenizer files here are a character vocabulary's, a few KB).
"""

import argparse
import json
import tempfile
import time
from pathlib import Path
from types import SimpleNamespace

import torch
from hydra import compose, initialize_config_dir

from gptlab import config as _schema  # noqa: F401 - registers conf/config.yaml's schema
from gptlab.checkpoint.state import TrainingState, save_state
from gptlab.data.tokenizers import CharTokenizer
from gptlab.model.gpt import GPT, GPTConfig
from gptlab.registry import serving

CONF = Path(__file__).resolve().parents[1] / "conf"


def model_config(name: str, vocab: int) -> dict:
    with initialize_config_dir(version_base="1.3", config_dir=str(CONF)):
        cfg = compose(config_name="config", overrides=[f"model={name}"])
    fields = set(GPTConfig.__dataclass_fields__)
    values = {k: v for k, v in dict(cfg.model).items() if k in fields}
    return {**values, "vocab_size": vocab}


def size_of(folder: Path) -> int:
    return sum(p.stat().st_size for p in folder.rglob("*") if p.is_file())


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--model", default="gpt_char")
    p.add_argument("--vocab", type=int, default=65)
    p.add_argument("--rounds", type=int, default=2)
    args = p.parse_args()
    import mlflow

    mc = model_config(args.model, args.vocab)
    model = GPT(GPTConfig(**mc))
    optimizer = torch.optim.AdamW(model.parameters(), lr=1e-4)
    model(torch.zeros(1, 8, dtype=torch.long), torch.zeros(1, 8, dtype=torch.long))[1].backward()
    optimizer.step()  # AdamW's moments exist, as in a run's checkpoint
    tok = CharTokenizer("".join(chr(32 + i) for i in range(min(args.vocab, 95))))
    params = sum(p.numel() for p in model.parameters())
    with tempfile.TemporaryDirectory(prefix="gptlab-logbench-") as tmp:
        root = Path(tmp)
        run_dir = root / "run"
        (run_dir / "checkpoints").mkdir(parents=True)
        uri = f"sqlite:///{root / 'mlflow.db'}"
        client = mlflow.MlflowClient(uri)
        experiment = client.create_experiment("logbench", artifact_location=str(root / "art"))
        run_id = client.create_run(experiment).info.run_id
        state = TrainingState.capture(
            {"model": model, "optimizer": optimizer, "scaler": torch.amp.GradScaler("cpu"),
             "loader": SimpleNamespace(state_dict=lambda: {})},
            step=100, tokens=0, best_val_loss=1.0, config={}, model_config=mc,
            tokenizer=tok.to_meta(), mlflow_run_id=run_id,
        )  # fmt: skip
        ckpt = save_state(run_dir / "checkpoints", state, None, keep=1)
        results = {"steps": 100, "best_val_loss": 1.0, "best_val_bpb": 1.44}
        times = []
        for _ in range(args.rounds):
            t0 = time.perf_counter()
            info = serving.log_checkpoint(run_dir, uri, run_id, results)
            times.append(time.perf_counter() - t0)
        logged = next((root / "art").rglob(f"{info.model_id}"))
        print(json.dumps({
            "model": args.model, "vocab": args.vocab, "params": params,
            "checkpoint_mb": round(size_of(ckpt) / 1e6, 1) if ckpt.is_dir()
            else round(ckpt.stat().st_size / 1e6, 1),
            "logged_model_mb": round(size_of(logged) / 1e6, 1),
            "log_seconds": [round(t, 2) for t in times],
        }))  # fmt: skip


if __name__ == "__main__":
    main()
