import sys
from kvcmas_agents.bench.methods import METHODS, Method
from kvcmas_agents.cli import main
METHODS["kvcmas-f005"] = Method("kvcmas-f005", "kvcmas", uncorrected_energy=0.005)
METHODS["kvcmas-f002"] = Method("kvcmas-f002", "kvcmas", uncorrected_energy=0.002)
sys.exit(main(["bench", "--preset", "full", "--traces", "pipeline", "--device", "cpu", "--no-sweep", "--methods", "none",
               "kvcmas-f005", "kvcmas-f002", "--throughput-tokens", "0", "--out", "/tmp/dev/bench_faint"]))
