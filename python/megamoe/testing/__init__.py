"""What the tests and the benchmarks build around the kernels, never the serving path: problems with their exact
references (gemm, expert_ffn), the checks that compare kernel outputs with them (expert_ffn_checks, dispatch_combine)
and the one-process-per-GPU harness (ranks). The launchers in megamoe.kernels take plain tensors; these modules
make the tensors and judge the results."""
