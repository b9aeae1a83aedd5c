# The IPC launch measured alone and beside other work (benchmarks/ipc_launch.py --beside).
#   bash scripts/device_beside.sh [mode ...]   (default: none agent thread gpu-agent gpu-process cuda-process)
source scripts/device_env.sh
modes=${*:-none agent thread gpu-agent gpu-process cuda-process}
for b in $modes; do echo "### beside $b"; timeout 120 python3 benchmarks/ipc_launch.py --beside $b --tokens 512,2048 2>&1 | grep -v "NIXL INFO" | tail -3; done
