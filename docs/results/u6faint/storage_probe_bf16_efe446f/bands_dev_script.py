"""Dev: the best two-band rank split (layers below m at rank r1, from m on at rank r2, one choice for
every request) that loses no more energy than rank 40 everywhere; same input as alloc_dev_script.py.
Printed: keys m=14, r1=12, r2=48: 0.872x the components; values m=18, r1=12, r2=48: 0.729x."""
import torch, itertools
from kvcmas_agents.engine.lowrank import faint_layers, rows_are_smaller
torch.set_num_threads(1)
calls = torch.load("/tmp/dev/captures.pt")
R=40
res={}
for side in ("dk","dv"):
    uni=0; best2=0; pl=0; L_lost=0
    spectra=[]
    for c in calls:
        d = c[side]
        if rows_are_smaller(d.shape[2], 64, R, side=="dk"): continue
        first = max(1, faint_layers([c["dk"]],[c["dv"]],0.01))
        s2 = torch.linalg.svdvals(d[first:].double()).pow(2).sum(1)   # [L', n] summed over heads
        spectra.append(s2)
    # global per-band choice: same split & ranks for all requests (a config knob), loss pooled
    tot_lost_uni = sum(s[:, R:].sum() for s in spectra)
    tails = [torch.cat([s.flip(-1).cumsum(-1).flip(-1), s.new_zeros(s.shape[0],1)],-1) for s in spectra]  # lost at rank r = tails[:, r]
    uni = sum(s.shape[0]*min(R,s.shape[1]) for s in spectra)
    # option: layer index relative to absolute layer 30; spectra start at `first`; use absolute split
    best=None
    for m in range(4, 30, 2):
        for r1 in range(8, 41, 4):
            for r2 in range(r1, 49, 4):
                lost=0; comp=0
                for c,s,t in zip([c for c in calls if not rows_are_smaller(c[side].shape[2],64,R,side=="dk")], spectra, tails):
                    first = 30 - s.shape[0]
                    n=s.shape[1]
                    for li in range(s.shape[0]):
                        r = r1 if first+li < m else r2
                        r=min(r,n); lost += t[li, r]; comp += r
                if lost <= tot_lost_uni*(1+1e-9) and (best is None or comp < best[0]):
                    best=(comp, m, r1, r2)
    print(side, "uniform", uni, "best 2-band", best, best[0]/uni, flush=True)
