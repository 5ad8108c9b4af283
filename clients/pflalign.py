"""pFLAlign client half: personalized initialization, the PFLAlign local update, the new offset.

One round on client i (ALGORITHMS.md 1.7, 1.8):

1. ``theta <- theta_g + Delta_i`` (trainable parameters only; buffers come from ``theta_g``, or
   from the client's own copy with ``pflalign-bn = local``, 1.13 A6);
2. ``T`` steps of :class:`pflalign.optim.PFLAlign` (``m`` reset; ``v``, ``P`` persistent);
3. ``Delta_i <- theta_end - theta_g`` against the global model received this round.

Where ``Delta_i`` lives is ``pflalign-state``: ``client`` keeps it in the node's state;
``server`` receives ``theta_g + Delta_i`` as ``arrays`` and ``Delta_i`` as ``offset`` in the
message (the strategy computes the new offset). ``v`` and ``P`` stay on the client in both modes:
they are never sent (1.5).

With ``pflalign-local-update = genie`` (the ``pflalign-genie`` variant, ALGORITHMS.md 4.2) step
2 is GENIE's rule instead, with ``m``, ``s`` and the step count persistent per client and no offset
correction; the rest of the round is unchanged.

Evaluation (1.12): ``personal-acc`` is ``theta_end`` from the client's last participation (scored
right after training when the server flags that no further training of this client precedes the
next evaluation, and kept in the client's state); ``personal-acc-next`` is ``theta_g + Delta_i``,
the next round's starting point; ``global-acc`` is ``theta_g``. A client that never trained uses
``theta_g + 0``, so unseen clients get the global model.
"""

from __future__ import annotations

import torch
from torch import nn

from clients.base import ClientMethod, FitResult, RoundInput, TorchState
from pflalign.optim import GENIE, PFLAlign
from pflalign.train import (
    STREAM_OPTIMIZER,
    STREAM_TRAIN,
    EvalStats,
    genie_options,
    make_generator,
    num_local_steps,
)

OFFSET, OPTIMIZER, FIT_EVAL, BUFFERS = "offset", "optimizer", "fit-eval", "buffers"
PERSONAL = "personal"


class PFLAlignClient(ClientMethod):
    @property
    def server_mode(self) -> bool:
        return self.settings["pflalign-state"] == "server"

    @property
    def local_bn(self) -> bool:
        return self.settings["pflalign-bn"] == "local"

    def offset(self, inputs: RoundInput) -> TorchState | None:
        """Delta_i: from the message in server mode, from the node's state in client mode."""
        if not self.settings["pflalign-personalize"]:
            return None
        return inputs.records.get(OFFSET) if self.server_mode else self.state.get_arrays(OFFSET)

    def _model(self, state: TorchState | None) -> nn.Module:
        """A model loaded with ``state``, with this client's own buffers in local-BN mode."""
        model = self.new_model(state)
        buffers = self.state.get_arrays(BUFFERS) if self.local_bn else None
        if buffers:
            model.load_state_dict(buffers, strict=False)
        return model

    @property
    def genie(self) -> bool:
        return self.settings["pflalign-local-update"] == "genie"

    def _genie(self, model: nn.Module, server_round: int,
               ) -> tuple[GENIE, list[str], list[torch.nn.Parameter]]:
        """GENIE over the trainable parameters with this client's persisted m, s and step count
        (ALGORITHMS.md 4.2); its mask and noise are seeded per (seed, round, client)."""
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        optimizer = GENIE([p for _, p in named], **genie_options(self.settings),
                          generator=make_generator(int(self.settings["seed"]), server_round,
                                                   self.client_id, STREAM_OPTIMIZER,
                                                   STREAM_TRAIN))
        saved = self.state.get_arrays(OPTIMIZER)
        if saved:
            for name, p in named:
                optimizer.state[p].update(step=int(saved[f"{name}.step"]),
                                          m=saved[f"{name}.m"].to(p.device),
                                          s=saved[f"{name}.s"].to(p.device))
        return optimizer, [n for n, _ in named], [p for _, p in named]

    def _optimizer(self, model: nn.Module,
                   ) -> tuple[PFLAlign, list[str], list[torch.nn.Parameter]]:
        """PFLAlign over the trainable parameters, with this client's persisted v and P."""
        s = self.settings
        named = [(n, p) for n, p in model.named_parameters() if p.requires_grad]
        precondition = bool(s["pflalign-precondition"])
        optimizer = PFLAlign([p for _, p in named],
                             lr=float(s["pflalign-lr"] if precondition else s["lr"]),
                             beta=float(s["pflalign-beta"]), eps=float(s["pflalign-eps"]),
                             precondition=precondition, gamma=str(s["pflalign-gamma"]))
        saved = self.state.get_arrays(OPTIMIZER)
        if saved:  # freshly deserialized tensors: the optimizer may own them
            for name, p in named:
                state = optimizer.state[p]
                state["v"] = saved[f"{name}.v"].to(p.device)
                state["P"] = saved[f"{name}.P"].to(p.device)
        return optimizer, [n for n, _ in named], [p for _, p in named]

    def _save_optimizer(self, optimizer: PFLAlign | GENIE, names: list[str]) -> None:
        params = [p for group in optimizer.param_groups for p in group["params"]]
        record = {}
        for name, p in zip(names, params, strict=True):
            state = optimizer.state[p]
            if isinstance(optimizer, GENIE):
                record.update({f"{name}.m": state["m"], f"{name}.s": state["s"],
                               f"{name}.step": torch.tensor(state["step"])})
            else:
                record[f"{name}.v"] = state["v"]
                record[f"{name}.P"] = state["P"]
        self.state.set_arrays(OPTIMIZER, record)

    def fit(self, inputs: RoundInput) -> FitResult:
        received = inputs.global_state
        offset = self.offset(inputs)
        model = self._model(received)
        optimizer, names, trained = (self._genie(model, inputs.server_round) if self.genie
                                     else self._optimizer(model))
        if offset and not self.server_mode:  # server mode receives theta_g + Delta already
            with torch.no_grad():
                torch._foreach_add_(trained, [offset[n].to(self.device) for n in names])
        steps = num_local_steps(self.data.num_train, int(self.settings["batch-size"]),
                                int(self.settings["local-epochs"]),
                                int(self.settings["local-steps"]))
        if not self.genie:
            optimizer.begin_round([offset[n] for n in names] if offset else None, steps)
        stats = self.local_train(model, inputs.server_round, optimizer=optimizer)

        if self.settings["pflalign-personalize"] and not self.server_mode:
            with torch.no_grad():
                new_offset = torch._foreach_sub(trained, [received[n].to(self.device)
                                                          for n in names])
            self.state.set_arrays(OFFSET, dict(zip(names, new_offset, strict=True)))
        self._save_optimizer(optimizer, names)
        if self.local_bn:
            trainable = set(names)
            self.state.set_arrays(BUFFERS, {k: v for k, v in model.state_dict().items()
                                            if k not in trainable})
        if inputs.config.get("evaluate-after-fit"):
            result = self.test(model)
            self.state.set_metrics(FIT_EVAL, {"correct": result.correct, "count": result.count,
                                              "loss-sum": result.loss_sum})
        metrics = {"train-loss": stats.loss, "local-steps": stats.steps}
        if not self.genie:
            metrics.update({"mean-P": optimizer.mean_preconditioner(),
                            "mean-gamma": optimizer.mean_gamma()})
        return FitResult(model.state_dict(), metrics)

    def _next_model(self, inputs: RoundInput) -> nn.Module | None:
        """theta_g + Delta_i, or None when it is the global model itself."""
        if self.server_mode:
            return self._model(inputs.records[PERSONAL]) if PERSONAL in inputs.records else None
        offset = self.offset(inputs)
        if not offset and not (self.local_bn and self.state.get_arrays(BUFFERS)):
            return None
        model = self._model(inputs.global_state)
        if offset:
            named = [(n, p) for n, p in model.named_parameters() if n in offset]
            with torch.no_grad():
                torch._foreach_add_([p for _, p in named],
                                    [offset[n].to(self.device) for n, _ in named])
        return model

    def evaluate(self, inputs: RoundInput) -> dict:
        global_result = self.test(self.new_model(inputs.global_state))
        next_model = self._next_model(inputs)
        next_result = global_result if next_model is None else self.test(next_model)
        stored = self.state.get_metrics(FIT_EVAL)
        personal = next_result if stored is None else EvalStats(
            correct=int(stored["correct"]), loss_sum=float(stored["loss-sum"]),
            count=int(stored["count"]))
        return {**self.eval_metrics(personal, global_result),
                "next-correct": next_result.correct}
