source scripts/device_env.sh
for b in none agent thread; do echo "### beside $b"; timeout 120 python3 benchmarks/ipc_launch.py --beside $b --tokens 512,2048 2>&1 | grep -v "NIXL INFO" | tail -3; done
