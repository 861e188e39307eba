"""Does BPA's prior precision λ track how well the global model does on each client?

    python diagnostics/bpa_precision.py [hydra overrides...]

Needs the default experiment's inputs (`dvc repro pretrain@mnist`). For the source model on each
target client's stream, prints the mean prediction entropy Ē, BPA's λ = (ln C − Ē)/σ₀² and the
accuracy, once in eval mode (the source BatchNorm statistics) and once with batch statistics (how
the client predicts), then the rank correlation of λ with the client's accuracy under each. λ
should be large (a tight prior) where the global model does well: BPA reads Ē with batch
statistics for this reason (docs/systems/bpfedctta.md).
"""

from __future__ import annotations

import sys
from pathlib import Path

import torch
from scipy.stats import spearmanr

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from fedcore.adapt import prior_precision, softmax_entropy  # noqa: E402
from fedcore.data import Partition  # noqa: E402
from fedcore.evaluate import batch_statistics  # noqa: E402
from fedcore.tensors import batches, to_tensor  # noqa: E402
from flows.config import compose as C  # noqa: E402
from flows.runs import federation as F  # noqa: E402


def main(argv) -> None:
    cfg = C.compose(argv)
    part = Partition.load(F.partition_dir(cfg))
    spec = C.model_spec(cfg)
    state = torch.load(F.source_model_path(cfg), weights_only=True)["state"]
    sigma0 = float(cfg.method.params.get("sigma0", 1.0)) if cfg.method.name == "bpa" else 1.0
    cols = {"eval": [], "batch": []}
    print(f"{'client':>16} | eval mode: Ē  λ  acc | batch statistics: Ē  λ  acc")
    for t in part.targets:
        model = spec.build()
        model.load_state_dict(state)
        x = to_tensor(t.stream_x)
        line = []
        for mode in cols:
            with torch.no_grad(), batch_statistics(model, mode == "batch"):
                logits = torch.cat([model(x[sl]) for sl in batches(len(x), int(cfg.adapt.batch_size))])
            ent = float(softmax_entropy(logits).mean())
            lam = prior_precision(ent, num_classes=spec.num_classes, sigma0=sigma0, mode="confidence")
            acc = float((logits.argmax(1).numpy() == t.stream_y).mean())
            cols[mode].append((lam, acc))
            line.append(f"{ent:.2f} {lam:.2f} {acc:.3f}")
        print(f"{t.corruption:>16} | {line[0]:>18} | {line[1]:>18}")
    for mode, rows in cols.items():
        rho = spearmanr([r[0] for r in rows], [r[1] for r in rows]).correlation
        print(f"rank correlation of λ with the client's accuracy, {mode}: {rho:+.2f}")


if __name__ == "__main__":
    main(sys.argv[1:])
