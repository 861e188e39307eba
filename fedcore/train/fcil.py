"""PP-FCIL's client (Privacy-Preserving Federated Class-Incremental Learning): dual model, exemplars,
the three-part loss, compression, and local (Bayesian) differential privacy.

One local round of task t on a client:

1. If the global model still holds task t − 1, switch it to t (:meth:`DualNet.advance`): every
   client of the round does the same switch on the same weights, so the server's average is the
   switched model.
2. Train on the task's new data plus the exemplar memory of the old classes:

   * training rounds: ``L = (1 − λ)·L_C + λ·L_D + ϱ·L_S`` on Φ_new, the fusion, the classifier and
     the projection head; λ = |old classes| / |seen classes|;
   * in the last ``compress_rounds`` rounds of every task after the first, after that training
     (``compress_schedule: after``, the paper's order), as many epochs of the compression loss
     ``L_M = (1 − λ)·L_C(fc(F_single)) + λ₀·‖F_mix − F_single‖²/d`` on ``single`` alone (the
     classifier is kept, so the compressed extractor must fit it; the squared distance is divided
     by the feature width d, so λ₀ does not depend on the backbone). Every round of a task trains,
     with or without compression. ``compress_schedule: replace`` compresses instead of training in
     those rounds.

3. Herd ``per_class`` exemplars of each class of the task from the trained features into the
   client's fixed-size memory (checkpointed with the server as the client's state).
4. Send the weights plus the numbers the server weights and selects by: new and cumulative
   sample counts, and the local model's accuracy, loss and Cohen's kappa on a share of the task's
   data the client held out of training (``report_on``).

Privacy (``privacy``): ``none``; ``lbdp`` (local Bayesian DP: DP-SGD with σ calibrated from the
client's own clipped-gradient distribution, accounted by :class:`BayesianAccountant`); ``dp``
(the classic baseline: the same DP-SGD with σ from Opacus' RDP calibration, accounted by
:class:`ClassicAccountant`). Batches are Poisson-sampled at rate ``sample_rate``; each step clips
every sample's gradient to ``clip_norm`` and adds N(0, σ²C²) to the sum. A client stops before
any step that would take its ε past ``epsilon``, and sends nothing in a round it cannot afford.
``clip`` is a diagnostic with no guarantee: ``dp``'s Poisson sampling, per-sample clipping and
division by the expected batch, with no noise, no account and no budget; set beside ``none`` and
``dp`` it separates what DP-SGD's mechanics cost from what its noise costs. The supervised contrastive loss
couples the samples of a batch, which per-sample clipping cannot bound, so private runs need ``rho = 0``.
``nbafl`` is the second baseline, NbAFL's uplink noise (:mod:`fedcore.privacy.nbafl`): plain local training, then
what the client sends (its change to the round's starting weights) clipped to norm ``clip_norm`` with N(0, σ_u²)
added to every coordinate, σ_u calibrated for the client's ⌈rounds·F⌉ planned uploads; a client that has made them
all sends nothing more. Every private form draws its noise and Poisson samples from OS entropy unless
``noise_source`` is ``seeded`` (reproducible research runs, with no guarantee).
"""

from __future__ import annotations

import os
from typing import Any, Dict, List, Mapping, Sequence, cast

import numpy as np
import torch
from torch import nn

from fedcore.incremental import losses as L
from fedcore.incremental.exemplars import ExemplarMemory, herding
from fedcore.models.base import FeatureNet
from fedcore.models.dual import NEW_INITS, DualNet
from fedcore.privacy.nbafl import planned_uploads
from fedcore.registry import check_choice
from fedcore.tensors import batches, state_to_cpu, to_tensor
from fedcore.train.base import TRAINERS, ClientUpdate, LocalTrainer, State, augment_batch

CLASSIFIER_LOSSES = ("balanced", "plain")
COMPRESSION = ("distil", "none")
COMPRESS_SCHEDULES = ("after", "replace")
REPORT_SOURCES = ("holdout", "train")  # what the accuracy, loss and kappa a client reports are measured on
PRIVACY = ("none", "lbdp", "dp", "clip", "nbafl")
EXEMPLAR_RULES = ("herding", "random", "none")
NBAFL_SENSITIVITY = ("average", "worst")
SIGMA_SOURCES = ("accounted", "probe")
PLAN_BATCHES = 2
"""How many of its last charged batches an LBDP client keeps to plan the next round's σ on."""


@TRAINERS.register("fcil")
class FCILTrainer(LocalTrainer):
    """PP-FCIL's local training. Every setting is keyword-only; see the module docstring.

    Parameters
    ----------
    rho, kd_temperature, supcon_temperature:
        ϱ (weight of L_S), τ of the distillation, and the contrastive temperature.
    classifier_loss:
        ``balanced`` (balanced softmax, the paper's L_C) or ``plain`` cross-entropy (the −L_C ablation).
    distill:
        False drops L_D (the −L_D ablation).
    branches:
        2 (the dual model) or 1 (the single-branch ablation: F_mix = F_new; Φ_old only teaches).
    compress, compress_rounds, compress_schedule, lambda0, new_init:
        ``distil`` compresses the dual model into one in the last ``compress_rounds`` rounds of each
        task (λ₀ weights the feature term); ``none`` makes Φ_new the next Φ_old without distillation.
        ``compress_schedule``: ``after`` (those rounds train, then compress; a private client plans its
        budget for the extra steps) or ``replace`` (those rounds only compress).
        ``new_init``: Φ_new restarts ``random`` (the paper) or from the new Φ_old.
    memory, per_class, exemplars:
        Exemplar memory capacity (samples), exemplars per old class, and the rule: ``herding``, ``random``, or
        ``none`` (no replay: the fine-tuning lower bound).
    privacy, epsilon, delta, clip_norm, sample_rate:
        See the module docstring; ``epsilon`` is the client's ε_total over the whole run.
    bdp_estimator, bdp_confidence:
        How LBDP's accountant estimates the expectation over records: ``ucb`` (the default: a one-sided
        Student-t upper confidence bound on it, so the account holds with probability 1 − ``bdp_confidence``
        per step; Triastcyn & Faltings' form) or ``mean`` (the sample mean of the batch's clipped norms).
    epsilon_conversion:
        How both private forms turn their privacy cost into ε: ``balle`` (Balle et al. 2020, Theorem 21, as
        Opacus does; the default) or ``chernoff`` (the BDP paper's bound). One setting for LBDP and classic
        DP, so that they report the same ε for the same noise when every gradient is clipped.
    bdp_sigma_from:
        Where LBDP's σ comes from each round: ``accounted`` (the default: the clipped norms of the last
        ``PLAN_BATCHES`` batches of the client's previous round in the same task, each already charged to its
        account on its own norms, the planned step cost being their mean; d = 1, the classic σ, in its first
        round of each task) or ``probe`` (the clipped norms of up to 64 records drawn for the purpose, which no
        step accounts).
    report_on, holdout_fraction:
        What the accuracy, loss and kappa a client reports (A_k of the multi-factor weights, and the vector
        that selection compares) are measured on: ``holdout`` (the default: ``holdout_fraction`` of the
        client's data of each task, drawn once per task and never trained on; a client with too little data
        to hold out one sample reports on its training data) or ``train`` (the round's training data, which
        a trained model fits almost perfectly).
    noise_source:
        Where the private forms draw their noise and their Poisson samples: ``secure`` (OS entropy, the
        default: nobody can regenerate them) or ``seeded`` (the round's torch generator, from the run's
        seed: reproducible bit for bit, but anyone who reads the seed can subtract the noise and knows
        which records each step used, so no guarantee holds; research grids only).
    nbafl_sensitivity:
        What one record can change in an NbAFL upload: ``average`` (NbAFL's 2C/m, m the client's training
        samples: its assumption that the local model is an average of per-record terms each within C) or
        ``worst`` (2C, all that clipping the update to C bounds without that assumption).
    """

    def __init__(
        self,
        *,
        rho: float = 0.1,
        kd_temperature: float = 2.0,
        supcon_temperature: float = 0.1,
        classifier_loss: str = "balanced",
        distill: bool = True,
        branches: int = 2,
        compress: str = "distil",
        compress_rounds: int = 1,
        compress_schedule: str = "after",
        lambda0: float = 1.0,
        new_init: str = "random",
        memory: int = 200,
        per_class: int = 20,
        exemplars: str = "herding",
        privacy: str = "none",
        epsilon: float = 8.0,
        delta: float = 1e-5,
        clip_norm: float = 1.0,
        sample_rate: float = 0.1,
        bdp_estimator: str = "ucb",
        bdp_confidence: float = 0.05,
        epsilon_conversion: str = "balle",
        bdp_sigma_from: str = "accounted",
        nbafl_sensitivity: str = "average",
        noise_source: str = "secure",
        report_on: str = "holdout",
        holdout_fraction: float = 0.1,
        **kw,
    ) -> None:
        super().__init__(**kw)
        if self.lr_schedule != "constant" or self.channels_last or self.augment_mode == "sample":
            raise ValueError(
                "the fcil trainer runs its own loop: it takes lr_schedule=constant, channels_last=false "
                "and augment true or false"
            )
        if rho < 0 or lambda0 < 0:
            raise ValueError(f"loss weights must be >= 0, got rho={rho}, lambda0={lambda0}")
        if kd_temperature <= 0 or supcon_temperature <= 0:
            raise ValueError(
                f"temperatures must be > 0, got kd_temperature={kd_temperature}, "
                f"supcon_temperature={supcon_temperature}"
            )
        check_choice("classifier_loss", classifier_loss, CLASSIFIER_LOSSES)
        check_choice("compress", compress, COMPRESSION)
        check_choice("compress_schedule", compress_schedule, COMPRESS_SCHEDULES)
        check_choice("new_init", new_init, NEW_INITS)
        check_choice("exemplars", exemplars, EXEMPLAR_RULES)
        check_choice("privacy", privacy, PRIVACY)
        from fedcore.privacy.bayesian import CONVERSIONS, ESTIMATORS

        check_choice("bdp_estimator", bdp_estimator, ESTIMATORS)
        check_choice("epsilon_conversion", epsilon_conversion, CONVERSIONS)
        check_choice("bdp_sigma_from", bdp_sigma_from, SIGMA_SOURCES)
        check_choice("nbafl_sensitivity", nbafl_sensitivity, NBAFL_SENSITIVITY)
        check_choice("report_on", report_on, REPORT_SOURCES)
        if not 0 < holdout_fraction < 1:
            raise ValueError(
                f"holdout_fraction (the share of each task's data a client holds out to report its accuracy "
                f"on) must be in (0, 1), got {holdout_fraction}; e.g. 0.1"
            )
        from fedcore.privacy.dp import check_noise_source

        check_noise_source(noise_source)
        if not 0 < bdp_confidence < 1:
            raise ValueError(
                f"bdp_confidence (γ of the ucb estimator: its bound holds with probability 1 − γ per "
                f"step) must be in (0, 1), got {bdp_confidence}; e.g. 0.05"
            )
        if branches not in (1, 2):
            raise ValueError(f"branches must be 2 (the dual model) or 1 (the single-branch ablation), got {branches}")
        if compress_rounds < 1:
            raise ValueError(
                f"compress_rounds must be >= 1, got {compress_rounds}; use compress=none to skip the compression step"
            )
        ExemplarMemory(capacity=memory, per_class=per_class)  # its own checks: per_class <= capacity, both >= 1
        if privacy != "none":
            from fedcore.privacy.accountant import check_clip_norm, check_delta, check_epsilon

            check_epsilon(epsilon)
            check_delta(delta)
            check_clip_norm(clip_norm)
            if not 0 < sample_rate <= 1:
                raise ValueError(f"sample_rate (Poisson sampling rate q) must be in (0, 1], got {sample_rate}")
            if rho > 0:
                raise ValueError(
                    "private training needs rho=0: the supervised contrastive loss couples the samples "
                    "of a batch, so clipping each sample's gradient does not bound its influence"
                )
            if classifier_loss == "balanced":
                raise ValueError(
                    "private training needs classifier_loss=plain: the balanced softmax's prior is the "
                    "client's class counts, which every record changes, so one record would move every "
                    "sample's gradient"
                )
            if exemplars == "herding":
                raise ValueError(
                    "private training needs exemplars=random (or none): herding picks exemplars by the "
                    "class mean of every record, a release the privacy ledger does not account"
                )
        self.rho, self.kd_temperature, self.supcon_temperature = (
            float(rho),
            float(kd_temperature),
            float(supcon_temperature),
        )
        self.classifier_loss, self.distill, self.branches = classifier_loss, bool(distill), int(branches)
        self.compress, self.compress_rounds, self.lambda0 = compress, int(compress_rounds), float(lambda0)
        self.compress_schedule = compress_schedule
        self.new_init, self.memory, self.per_class, self.exemplars = new_init, int(memory), int(per_class), exemplars
        self.privacy, self.epsilon, self.delta = privacy, float(epsilon), float(delta)
        self.clip_norm, self.sample_rate = float(clip_norm), float(sample_rate)
        self.bdp_estimator, self.bdp_confidence = bdp_estimator, float(bdp_confidence)
        self.epsilon_conversion, self.bdp_sigma_from = epsilon_conversion, bdp_sigma_from
        self.nbafl_sensitivity, self.noise_source = nbafl_sensitivity, noise_source
        self.report_on, self.holdout_fraction = report_on, float(holdout_fraction)

    needs_features = True

    def _held_out(self, kept: Dict[str, Any] | None, *, task: int, n: int, seed: int) -> np.ndarray:
        """Which of the client's ``n`` samples of ``task`` it holds out to report on: the same all task long."""
        if self.report_on != "holdout":
            return np.zeros(0, dtype=np.int64)
        if kept is not None and int(kept["task"]) == task and int(kept["n"]) == n:
            return np.asarray(kept["index"], dtype=np.int64)
        k = int(self.holdout_fraction * n)
        if k < 1 or k >= n:  # too little data to hold any out: the client reports on what it trained on
            return np.zeros(0, dtype=np.int64)
        return np.sort(np.random.default_rng([seed, task, n]).choice(n, size=k, replace=False))

    # ------------------------------------------------------------------ the round
    def train(
        self,
        model: nn.Module,
        x: np.ndarray,
        y: np.ndarray,
        *,
        global_state: State,
        seed: int,
        broadcast: Dict[str, Any] | None = None,
        client_state: Dict[str, Any] | None = None,
        device: torch.device | str = "cpu",
    ) -> ClientUpdate:
        if not isinstance(model, DualNet):
            raise ValueError(
                f"the fcil trainer needs PP-FCIL's dual model, got {type(model).__name__}; "
                "use a model named dual-<backbone> (dual-lenet, dual-cnn, ...)"
            )
        b, cs = broadcast or {}, dict(client_state or {})
        if "task" not in b:
            raise ValueError(
                "the fcil trainer needs data that arrives in tasks (RoundData with client_task, "
                "task_classes and rounds_per_task)"
            )
        task, task_classes, per_task = int(b["task"]), [list(c) for c in b["task_classes"]], int(b["rounds_per_task"])
        if self.compress == "distil" and self.compress_rounds > per_task - int(self.compress_schedule == "replace"):
            raise ValueError(
                f"compress_rounds ({self.compress_rounds}) must be at most rounds_per_task ({per_task}), and below "
                "it with compress_schedule=replace: each task needs at least one training round"
            )
        g = torch.Generator().manual_seed(seed)
        model.to(device)
        while int(model.task) < task:  # a task no client could train (all out of budget) is passed through
            model.advance(
                int(model.task) + 1,
                compressed=self.compress == "distil",
                new_init=self.new_init,
                seed=int(b.get("seed", 0)),
            )
        model.fuse.fill_(int(self.branches == 2))
        within = int(b["round"]) - task * per_task
        compress_round = (
            self.compress == "distil" and bool(int(model.has_old)) and within >= per_task - self.compress_rounds
        )
        # "after": the round trains, then distils the dual model it trained into ``single``; "replace": it only
        # distils the global dual model it received
        phases = ["train"]
        if compress_round:
            phases = ["train", "compress"] if self.compress_schedule == "after" else ["compress"]
        num_classes = model.fc.out_features
        seen = _mask(num_classes, [c for t in task_classes[: task + 1] for c in t])
        old = _mask(num_classes, [c for t in task_classes[:task] for c in t])
        lam = float(old.sum()) / float(seen.sum())

        memory = (
            ExemplarMemory.from_state_dict(cs["memory"])
            if "memory" in cs
            else ExemplarMemory(capacity=self.memory, per_class=self.per_class)
        )
        held = self._held_out(cs.get("holdout"), task=task, n=len(x), seed=int(b.get("seed", 0)))
        xh, yh = x[held], y[held]
        x, y = np.delete(x, held, axis=0), np.delete(y, held)
        mx, my = memory.data()
        keep = np.isin(my, np.flatnonzero(old.numpy())) if len(my) else np.zeros(0, bool)
        xs = np.concatenate([x, mx[keep]]) if keep.any() else x
        ys = np.concatenate([y, my[keep]]) if keep.any() else y
        xt, yt = to_tensor(xs, device=device), torch.as_tensor(np.asarray(ys), dtype=torch.long, device=device)
        counts = torch.bincount(yt, minlength=num_classes).cpu()

        counts_by_task = dict(cs.get("counts_by_task", {}))
        counts_by_task[task] = int(len(x))
        ledger = dict(cs.get("ledger", {}))  # released with the run (privacy_ledger.json): nothing about records
        lbdp_norms = dict(cs.get("lbdp_norms", {}))  # LBDP's accounted clipped norms: kept by the client, never sent
        stopped = bool(ledger.get("exhausted", False))
        phase_params = {phase: self._phase_params(model, phase) for phase in phases}
        privacy_metrics: Dict[str, float] = {}
        if self.privacy == "nbafl":
            from fedcore.privacy.dp import check_private_model

            check_private_model(model)  # BatchNorm's running statistics would be released without noise
            trained = {id(p) for ps in phase_params.values() for p in ps}
            start = {n: p.detach().clone() for n, p in model.named_parameters() if id(p) in trained}
            planned = planned_uploads(b.get("rounds", 1), b.get("participation", 1.0))
            stopped = stopped or int(ledger.get("uploads", 0)) >= planned
            if stopped:  # every planned upload made: nothing more is sent
                ledger["exhausted"] = True
                phases = []
                privacy_metrics = {
                    "epsilon": float(ledger.get("epsilon", 0.0)),
                    "sigma": float(ledger.get("sigma", float("nan"))),
                    "budget_exhausted": 1.0,
                }
        losses: Dict[str, float] = {}
        steps = 0
        for phase in phases:
            compressing = phase == "compress"
            model.train()
            if compressing:
                model.new.eval()  # the dual model is the teacher now: its features, and BatchNorm statistics, stay put
            params = phase_params[phase]
            opt = torch.optim.SGD(params, lr=self.lr, momentum=self.momentum, weight_decay=self.weight_decay)
            objective = _Objective(self, model, seen=seen, old=old, lam=lam, counts=counts, compressing=compressing)
            if self.privacy in ("none", "nbafl"):
                total, count, taken = self._plain_epochs(objective, opt, xt, yt, g)
            else:
                total, count, taken, ledger, privacy_metrics = self._private_epochs(
                    objective,
                    opt,
                    params,
                    xt,
                    yt,
                    g,
                    ledger=ledger,
                    broadcast=b,
                    stopped=stopped,
                    lbdp_norms=lbdp_norms,
                )
                stopped = bool(ledger.get("exhausted", False))
            losses[phase] = total / max(count, 1)
            steps += taken
            if compressing:
                model.phase.fill_(1)  # the model in use is ``single`` from here: the task's score, the next Φ_old
            if stopped:  # out of budget: no step of a later phase either
                break
        if compress_round and self.compress_schedule == "replace":
            model.phase.fill_(1)
        elif not compress_round:
            model.phase.fill_(0)
        compressing = bool(int(model.phase))

        # exemplars of this task's classes, from the features of the model just trained
        model.eval()
        rng = np.random.default_rng(seed)
        with torch.no_grad():
            xn = to_tensor(x, device=device)
            feats = (
                torch.cat(
                    [
                        model.embed(xn[sl]) if not compressing else cast(FeatureNet, model.single).embed(xn[sl])
                        for sl in batches(len(xn), 256)
                    ]
                )
                .cpu()
                .numpy()
                if len(x)
                else np.zeros((0, 1))
            )
        for c in sorted(set(int(v) for v in np.unique(y))) if self.exemplars != "none" else []:
            idx = np.flatnonzero(y == c)
            order = (
                herding(features=feats[idx], m=self.per_class)
                if self.exemplars == "herding"
                else rng.permutation(len(idx))[: self.per_class]
            )
            memory.update(cls=c, x=x[idx], order=np.asarray(order))
        if self.privacy == "nbafl" and not stopped:  # before the report: it describes the model the server gets
            ledger, privacy_metrics = self._nbafl_release(model, start, ledger, n=len(xt), planned=planned, g=g)
        report = (
            _local_report(
                model,
                to_tensor(xh, device=device),
                torch.as_tensor(yh, dtype=torch.long, device=device),
                seen=seen,
                num_classes=num_classes,
            )
            if len(held)
            else _local_report(model, xt, yt, seen=seen, num_classes=num_classes)
        )
        new_state = {"memory": memory.state_dict(), "counts_by_task": counts_by_task}
        if self.report_on == "holdout":
            new_state["holdout"] = {"task": task, "n": int(len(x) + len(held)), "index": held.tolist()}
        if self.privacy != "none":
            new_state["ledger"] = ledger
        if lbdp_norms:
            new_state["lbdp_norms"] = lbdp_norms
        payload = {
            "new_examples": int(len(x)),
            "total_examples": int(sum(counts_by_task.values())),
            "accuracy": report["accuracy"],
            "loss": report["loss"],
            "kappa": report["kappa"],
            "stopped": bool(steps == 0 and stopped),
        }
        metrics = {
            "train_loss": losses.get("train", losses.get("compress", 0.0)),
            "steps": float(steps),
            "lambda": lam,
            "memory_bytes": float(memory.nbytes),
            "compressing": float(compress_round),
            **({"compress_loss": losses["compress"]} if "compress" in losses else {}),
            **privacy_metrics,
        }
        if payload["stopped"]:  # nothing trained: the update is the global model, and the server drops it
            return ClientUpdate(
                state={k: v.clone() for k, v in global_state.items()},
                num_examples=0,
                metrics=metrics,
                client_state=new_state,
                payload=payload,
            )
        return ClientUpdate(
            state=state_to_cpu(model.state_dict()),
            num_examples=int(len(xt)),
            metrics=metrics,
            client_state=new_state,
            payload=payload,
        )

    @staticmethod
    def _phase_params(model: DualNet, phase: str) -> List[nn.Parameter]:
        """What a phase trains: Φ_new, the fusion, the classifier and the head; or, compressing, ``single`` alone
        (the classifier stays, so the compressed extractor must fit it)."""
        if phase == "compress":
            return list(model.single.parameters())
        return [
            p
            for n, p in model.named_parameters()
            if n.split(".")[0] in ("new", "fusion", "fc", "proj") and p.requires_grad
        ]

    # ------------------------------------------------------------------ loops
    def _plain_epochs(self, objective: "_Objective", opt, xt, yt, g):
        total, count, steps = 0.0, 0, 0
        for _ in range(self.local_epochs):
            perm = torch.randperm(len(xt), generator=g).to(xt.device)
            for sl in batches(len(xt), self.batch_size):
                idx = perm[sl]
                xb, yb = xt[idx], yt[idx]
                if self.augment:
                    xb = augment_batch(xb, g)
                loss = objective.batch_loss(xb, yb, g)
                opt.zero_grad(set_to_none=True)
                loss.backward()
                opt.step()
                total += float(loss.detach()) * len(idx)
                count += len(idx)
                steps += 1
        return total, count, steps

    def _private_epochs(
        self, objective: "_Objective", opt, params, xt, yt, g, *, ledger, broadcast, stopped, lbdp_norms: Dict[str, Any]
    ):
        """DP-SGD epochs under the ledger's account. ``lbdp_norms`` (the client's own state, updated in place) keeps the
        clipped norms LBDP's steps were charged for, from which its next round takes σ."""
        from fedcore.privacy.bayesian import calibrate_sigma_bdp, calibrate_sigma_classic, create_accountant
        from fedcore.privacy.dp import check_private_model, gaussian_noise

        check_private_model(objective.model)
        name = "bayesian" if self.privacy == "lbdp" else "classic"
        clip_only = self.privacy == "clip"  # the mechanics without noise: nothing to account, no budget
        bdp: Dict[str, Any] = (
            {"estimator": self.bdp_estimator, "confidence": self.bdp_confidence} if name == "bayesian" else {}
        )
        conversion = self.epsilon_conversion
        acct = create_accountant(name, conversion=conversion, **bdp)
        if "accountant" in ledger:
            acct.load_state_dict(ledger["accountant"])
        q, n = self.sample_rate, len(xt)
        steps_per_round = max(1, int(round(self.local_epochs / q)))
        expected = max(1.0, q * n)
        rounds, part = int(broadcast.get("rounds", 1)), float(broadcast.get("participation", 1.0))
        uploads = planned_uploads(rounds, part)
        if self.compress == "distil" and self.compress_schedule == "after":
            # a round that compresses takes its training steps and as many compression steps: plan for every
            # compression round the client could be picked for
            uploads += min(uploads, (len(broadcast.get("task_classes", [])) - 1) * self.compress_rounds)
        planned = max(steps_per_round, uploads * steps_per_round)  # this client's whole run
        trainable = {id(p) for p in params}
        named = {k: p for k, p in objective.named_parameters() if id(p) in trainable}
        total, count, steps, sigmas, sq_all, norms_all = 0.0, 0, 0, [], [], []
        accounted: List[np.ndarray] = []
        task = int(broadcast.get("task", 0))
        sigma = float(ledger.get("sigma", 0.0))
        if name == "classic" and sigma == 0.0 and not clip_only:
            sigma = calibrate_sigma_classic(
                q=q, steps=planned, epsilon=self.epsilon, delta=self.delta, conversion=conversion
            )
        sq_seen = None  # the latest sample of clipped norms: the data distribution the Bayesian cost is taken over
        if name == "bayesian" and acct.steps >= planned:
            # every planned step is taken (a ledger the end-of-round mark below did not close: one checkpointed by
            # older code), and σ was planned to spend ε_total over those: the little that is left buys steps only
            # at σ near SIGMA_MAX, an update of pure noise. The client stops, as classic DP's does.
            ledger["exhausted"] = True
            stopped = True
        if name == "bayesian" and not stopped:  # (clip_only is "classic")
            # data-aware noise: the σ that spends what is left of ε_total over this client's remaining planned
            # steps, at a sample of its clipped-gradient distribution: by default the clipped norms its previous
            # round's steps were charged for (d = 1 before any step: a σ that reads no data), or a probe of up
            # to 64 records (which no step accounts)
            plan: Any
            if self.bdp_sigma_from == "probe":
                probe = torch.randperm(n, generator=g)[:64].to(xt.device)
                plan = sq_seen = self._clipped_sq(objective, named, xt[probe], yt[probe])[0]
                if self.bdp_estimator == "ucb" and len(sq_seen) < 2:
                    raise ValueError(
                        f"bdp_estimator=ucb needs at least 2 samples on a client to estimate a spread; this "
                        f"client has {n}. Use bdp_estimator=mean, or give every client more data"
                    )
            else:  # batches of this task already charged on their own norms; none yet: d = 1, no data read
                kept = lbdp_norms.get("batches", []) if lbdp_norms.get("task") == task else []
                plan = [np.asarray(batch, dtype=float) for batch in kept] or np.ones(2)
            try:
                sigma = calibrate_sigma_bdp(
                    conversion=conversion,
                    sq_norms=plan,
                    q=q,
                    steps=max(1, planned - acct.steps),
                    epsilon=self.epsilon,
                    delta=self.delta,
                    spent=acct.total_cost if acct.steps else None,
                    **bdp,
                )
            except ValueError:  # what is left of ε_total buys no step at any σ: the budget is spent
                ledger["exhausted"] = True
                stopped = True
        for _ in range(0 if stopped else steps_per_round):
            pick = _poisson_pick(n, q, g, self.noise_source)  # each sample joins with probability q
            idx = torch.nonzero(pick).flatten().to(xt.device)
            xb, yb = xt[idx], yt[idx]
            own = False  # is this step charged on its own batch's norms?
            if len(idx):
                sq, norms, per_sample, aux = self._clipped_sq(objective, named, xb, yb)
                if len(sq) >= 2 or self.bdp_estimator == "mean":  # ucb needs a spread: keep the last one it had
                    sq_seen, own = sq, True
            if not clip_only:
                cost = acct.step_cost(sq_norms=sq_seen if sq_seen is not None else np.ones(2), q=q, sigma=sigma)
                if acct.epsilon_after(cost, self.delta) > self.epsilon:
                    ledger["exhausted"] = True
                    break
                acct.spend(cost)  # an empty batch is still a step: it releases noise, and the analysis counts it
                if name == "bayesian" and own:
                    accounted.append(sq)  # charged on these norms: the next round of the task plans σ on them
            if len(idx):
                norms_all.append(norms.detach().cpu().numpy())
            opt.zero_grad(set_to_none=True)
            for key, p in named.items():
                summed = (
                    torch.zeros_like(p)
                    if not len(idx)
                    else torch.einsum("b,b...->...", (self.clip_norm / (norms + 1e-12)).clamp(max=1.0), per_sample[key])
                )
                noise = (
                    torch.randn(summed.shape, generator=g).to(summed.device) * sigma * self.clip_norm
                    if self.noise_source == "seeded"
                    else gaussian_noise(summed.shape, std=sigma * self.clip_norm, source="secure", device=summed.device)
                )
                p.grad = (summed + noise) / expected
            opt.step()
            if len(idx):
                with torch.no_grad():
                    total += float(objective.sample_loss(objective(xb), aux, {}).sum())
                count += len(idx)
                sq_all.append(float(np.mean(sq)))
            steps += 1
            sigmas.append(sigma)
        clip_stats = self._clip_stats(np.concatenate(norms_all) if norms_all else np.zeros(0))
        if clip_only:  # no ledger: nothing is promised
            return (
                total,
                count,
                steps,
                ledger,
                {"sigma": 0.0, "clipped_sq_norm": float(np.mean(sq_all)) if sq_all else float("nan"), **clip_stats},
            )
        if acct.steps >= planned:  # the plan's last step is taken: tell the server now, so that it retires this
            ledger["exhausted"] = True  # client (as NbAFL's after its last upload) rather than pick it for nothing
        if accounted:
            lbdp_norms.update(task=task, batches=[[float(v) for v in batch] for batch in accounted[-PLAN_BATCHES:]])
        ledger.update(
            {
                "accountant": acct.state_dict(),
                "epsilon": float(acct.epsilon(self.delta)) if acct.steps else 0.0,
                "sigma": sigma if name == "classic" else ledger.get("sigma", 0.0),
            }
        )
        metrics = {
            "epsilon": ledger["epsilon"],
            "sigma": float(np.mean(sigmas)) if sigmas else float("nan"),
            "clipped_sq_norm": float(np.mean(sq_all)) if sq_all else float("nan"),
            "budget_exhausted": float(bool(ledger.get("exhausted", False))),
            **clip_stats,
        }
        return total, count, steps, ledger, metrics

    def _clip_stats(self, norms: np.ndarray) -> Dict[str, float]:
        """Where the round's per-sample gradient norms sit against C: the share clipped, the mean norm after
        clipping, and the median norm before it (NaN when the round drew no sample)."""
        if not norms.size:
            return {"clipped_fraction": float("nan"), "clipped_norm": float("nan"), "grad_norm_median": float("nan")}
        return {
            "clipped_fraction": float(np.mean(norms > self.clip_norm)),
            "clipped_norm": float(np.mean(np.minimum(norms, self.clip_norm))),
            "grad_norm_median": float(np.median(norms)),
        }

    def _nbafl_release(
        self,
        model: DualNet,
        start: Dict[str, torch.Tensor],
        ledger: Dict[str, Any],
        *,
        n: int,
        planned: int,
        g: torch.Generator,
    ):
        """NbAFL: replace the trained parameters by start + clip(trained − start) + N(0, σ_u²); one upload spent."""
        from fedcore.privacy.nbafl import clip_and_noise, nbafl_std

        std = nbafl_std(
            clip_norm=self.clip_norm,
            num_samples=n if self.nbafl_sensitivity == "average" else 1,
            exposures=planned,
            epsilon=self.epsilon,
            delta=self.delta,
        )
        named = dict(model.named_parameters())
        released, norm = clip_and_noise(
            {k: named[k].detach() - v for k, v in start.items()},
            clip_norm=self.clip_norm,
            std=std,
            generator=g,
            source=self.noise_source,
        )
        with torch.no_grad():
            for k, d in released.items():
                named[k].copy_(start[k] + d)
        uploads = int(ledger.get("uploads", 0)) + 1
        ledger = {
            **ledger,
            "uploads": uploads,
            "planned": planned,
            "epsilon": self.epsilon * uploads / planned,
            "sigma": std / self.clip_norm,
            "exhausted": uploads >= planned,
        }
        return ledger, {
            "epsilon": ledger["epsilon"],
            "sigma": ledger["sigma"],
            "update_norm": norm,
            "clipped_sq_norm": min(1.0, norm / self.clip_norm) ** 2,
            "budget_exhausted": float(ledger["exhausted"]),
        }

    def _clipped_sq(self, objective: "_Objective", named, xb, yb):
        """Per-sample gradients of the batch, their norms, and their squared clipped norms ‖clip(g)‖²/C²."""
        from fedcore.privacy.dp import flatten_per_sample, per_sample_grads_functorch

        aux = objective.aux(xb, yb)
        per_sample = per_sample_grads_functorch(objective, named, objective.sample_loss, xb, aux)
        norms = flatten_per_sample(per_sample).norm(dim=1)
        sq = ((norms.clamp(max=self.clip_norm) / self.clip_norm) ** 2).detach().cpu().numpy()
        return sq, norms, per_sample, aux


class _Objective(nn.Module):
    """The round's loss around the dual model; a module so torch.func can take per-sample gradients of it.

    ``forward(x)`` returns the logits and, in a compression round, the single model's features
    beside them; :meth:`sample_loss` turns those into one loss per sample (L_C + L_D, or L_M).
    """

    def __init__(self, trainer: FCILTrainer, model: DualNet, *, seen, old, lam: float, counts, compressing: bool):
        super().__init__()
        self.t, self.m, self.seen, self.old = trainer, model, seen, old
        self.lam, self.compressing = lam, compressing
        self.prior = L.log_prior(counts) if trainer.classifier_loss == "balanced" else None

    @property
    def model(self) -> DualNet:
        return self.m

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.compressing:
            f = cast(FeatureNet, self.m.single).embed(x)
            return torch.cat([self.m.fc(f), f], dim=1)
        return self.m.fc(self.m.embed(x))

    def aux(self, xb: torch.Tensor, yb: torch.Tensor) -> Dict[str, torch.Tensor]:
        """Per-sample targets computed without gradients: labels, the teacher's logits, F_mix."""
        out = {"y": yb}
        with torch.no_grad():
            if self.compressing:
                out["f_mix"] = self.m.mix(xb)[0]
            elif self.t.distill and bool(self.old.any()):
                out["teacher"] = self.m.teacher_logits(xb)
        return out

    def sample_loss(self, out: torch.Tensor, aux: Mapping[str, torch.Tensor], _params) -> torch.Tensor:
        """(B,) losses: (1 − λ)·L_C + λ·L_D per sample, or L_M in a compression round (no L_S: it is not per-sample)."""
        c = self.m.fc.out_features
        loss = (1 - self.lam) * L.classification(out[:, :c], aux["y"], seen=self.seen, prior=self.prior)
        if self.compressing:
            return loss + self.t.lambda0 * L.feature_match(aux["f_mix"], out[:, c:])
        if "teacher" in aux:
            loss = loss + self.lam * L.distillation(
                out[:, :c], aux["teacher"], old=self.old, temperature=self.t.kd_temperature
            )
        return loss

    def batch_loss(self, xb: torch.Tensor, yb: torch.Tensor, g: torch.Generator) -> torch.Tensor:
        """The batch's loss in a plain round: the per-sample terms averaged, plus ϱ·L_S on two views."""
        aux = self.aux(xb, yb)
        if self.compressing or self.t.rho == 0:
            return self.sample_loss(self(xb), aux, {}).mean()
        f_mix, f_new, _ = self.m.mix(xb)
        loss = self.sample_loss(self.m.fc(f_mix), aux, {}).mean()
        view = augment_batch(xb, g)
        z = self.m.proj(torch.cat([f_new, cast(FeatureNet, self.m.new).embed(view)]))
        return loss + self.t.rho * L.supcon(z, torch.cat([yb, yb]), temperature=self.t.supcon_temperature)


def _poisson_pick(n: int, q: float, g: torch.Generator, source: str) -> torch.Tensor:
    """(n,) bools, each True with probability q: from ``g`` (``seeded``) or from OS entropy (``secure``: 53-bit
    uniforms, so nobody who reads the run's seed learns which records a step used)."""
    if source == "seeded":
        return torch.rand(n, generator=g) < q
    words = np.frombuffer(os.urandom(8 * n), dtype=np.uint64)
    return torch.from_numpy((words >> np.uint64(11)).astype(np.float64) * 2.0**-53 < q)


def _mask(num_classes: int, classes: Sequence[int]) -> torch.Tensor:
    m = torch.zeros(num_classes, dtype=torch.bool)
    if classes:
        m[list(classes)] = True
    return m


@torch.no_grad()
def _local_report(
    model: DualNet, xt: torch.Tensor, yt: torch.Tensor, *, seen: torch.Tensor, num_classes: int
) -> Dict[str, float]:
    """Accuracy, loss and Cohen's kappa of the trained local model on the client's round data."""
    from fedcore.evaluate.metrics import cohen_kappa

    model.eval()
    if len(xt) == 0:
        return {"accuracy": 0.0, "loss": float("nan"), "kappa": 0.0}
    logits = torch.cat([model(xt[sl]) for sl in batches(len(xt), 256)])
    z = L.masked(logits, seen)
    pred = z.argmax(1)
    return {
        "accuracy": float((pred == yt).float().mean()),
        "loss": float(nn.functional.cross_entropy(z, yt)),
        "kappa": float(cohen_kappa(y_true=yt.cpu().numpy(), y_pred=pred.cpu().numpy(), num_classes=num_classes)),
    }


__all__: List[str] = ["FCILTrainer", "CLASSIFIER_LOSSES", "COMPRESSION", "PRIVACY", "EXEMPLAR_RULES"]
