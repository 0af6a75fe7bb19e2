"""Dev: components a per-layer (same rank in each KV head of a layer) and a per-matrix allocation of
rank by energy need to lose as much of the factored corrections' energy as rank 40 everywhere, over the
stored layers (faint leading layers left out at 0.01). Input: /tmp/dev/captures.pt, every deviation of
the fp32 bench pipeline (docs/results/u6faint: capture at the former defaults). Printed (keys, values):
per matrix 0.875x / 0.679x, per layer 0.885x / 0.690x."""
import torch
from kvcmas_agents.engine.lowrank import faint_layers, rows_are_smaller
torch.set_num_threads(2)
calls = torch.load("/tmp/dev/captures.pt")
print(len(calls), calls[0].keys())
R=40
tot = {"uniform":0, "per_layer":0, "per_matrix":0, "bands2":0}
for side in ("dk","dv"):
    uni=pl=pm=0
    for c in calls:
        d = c[side]
        if rows_are_smaller(d.shape[2], 64, R, side=="dk"): continue
        first = max(1, faint_layers([c["dk"]],[c["dv"]],0.01))
        s2 = torch.linalg.svdvals(d[first:].double()).pow(2)   # [L,KVH,n]
        n = s2.shape[-1]; r=min(R,n)
        lost_uni = s2[..., r:].sum()
        uni += s2.shape[0]*s2.shape[1]*r
        # per matrix greedy
        flat = s2.flatten().sort(descending=True).values
        total = flat.sum(); cum = flat.cumsum(0)
        pm += int((total-cum > lost_uni*(1+1e-9)).sum())+1
        # per layer: same rank for all heads of a layer; greedy over layer "components" (sum over heads)
        lay = s2.sum(1)  # [L, n]  component k of layer l summed over heads (costs KVH comps)
        fl = lay.flatten().sort(descending=True).values
        cuml = fl.cumsum(0)
        pl += (int((lay.sum()-cuml > lost_uni*(1+1e-9)).sum())+1)*s2.shape[1]
    print(side, "uniform", uni, "per_matrix", pm, pm/uni, "per_layer", pl, pl/uni)
