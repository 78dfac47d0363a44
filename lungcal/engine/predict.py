"""Run a MIL network over a loader and collect logits, attention and the head's input features."""
from __future__ import annotations

import torch
from torch import nn

__all__ = ["predict"]


@torch.no_grad()
def predict(network: nn.Module, loader, device=None) -> dict[str, torch.Tensor]:
    """``{"logits" (N, C), "labels" (N,), "attention" (N, K), "features"}`` of ``network`` (eval mode) on ``loader``."""
    network.eval()
    out: dict[str, list] = {"logits": [], "labels": [], "attention": [], "features": []}
    for batch in loader:
        bags = batch["bag"].to(device) if device is not None else batch["bag"]
        mask = batch["mask"].to(bags.device)
        if hasattr(network, "forward_features"):  # one pass: pooled features + attention
            feats, att = network.forward_features(bags, mask)
            logits = network.head(feats)
        else:
            feats = network.features(bags, mask)
            logits, att = network(bags, mask)
        out["logits"].append(logits.float().cpu())
        out["attention"].append(att.float().cpu())
        out["features"].append(feats.float().cpu())
        out["labels"].append(batch["label"].long().cpu())
    return {k: torch.cat(v) if v else torch.empty(0) for k, v in out.items()}
