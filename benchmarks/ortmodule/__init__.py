"""ORTModule (onnxruntime-training) as a peer: `peer.py` runs inside its own environment
(`make_env.sh`), `measure.py` starts it from `python -m benchmarks` and reads its figures."""
