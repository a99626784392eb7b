set terminal pngcairo size 1200,480 font ",10"
set output "bench/results/cpu2_202612_kv_retrieval.png"
set datafile separator ","
set logscale x
set grid
set xlabel "budget (fraction of the tokens kept)"
set key top right
set multiplot layout 1,2
set title "Relative bits-per-byte increase over the full cache, mean (95% CI), %"
plot "bench/results/cpu2_202612_kv_retrieval.csv" skip 1 using 2:(strcol(1) eq "full" ? 100*$6 : 1/0):(100*$7):(100*$8) with yerrorlines title "full", \
     "bench/results/cpu2_202612_kv_retrieval.csv" skip 1 using 2:(strcol(1) eq "window" ? 100*$6 : 1/0):(100*$7):(100*$8) with yerrorlines title "window", \
     "bench/results/cpu2_202612_kv_retrieval.csv" skip 1 using 2:(strcol(1) eq "h2o" ? 100*$6 : 1/0):(100*$7):(100*$8) with yerrorlines title "h2o", \
     "bench/results/cpu2_202612_kv_retrieval.csv" skip 1 using 2:(strcol(1) eq "snapkv" ? 100*$6 : 1/0):(100*$7):(100*$8) with yerrorlines title "snapkv", \
     "bench/results/cpu2_202612_kv_retrieval.csv" skip 1 using 2:(strcol(1) eq "tova" ? 100*$6 : 1/0):(100*$7):(100*$8) with yerrorlines title "tova", \
     "bench/results/cpu2_202612_kv_retrieval.csv" skip 1 using 2:(strcol(1) eq "expected-attention" ? 100*$6 : 1/0):(100*$7):(100*$8) with yerrorlines title "expected-attention", \
     "bench/results/cpu2_202612_kv_retrieval.csv" skip 1 using 2:(strcol(1) eq "adakv-h2o" ? 100*$6 : 1/0):(100*$7):(100*$8) with yerrorlines title "adakv-h2o", \
     "bench/results/cpu2_202612_kv_retrieval.csv" skip 1 using 2:(strcol(1) eq "adakv-snapkv" ? 100*$6 : 1/0):(100*$7):(100*$8) with yerrorlines title "adakv-snapkv", \
     "bench/results/cpu2_202612_kv_retrieval.csv" skip 1 using 2:(strcol(1) eq "adakv-tova" ? 100*$6 : 1/0):(100*$7):(100*$8) with yerrorlines title "adakv-tova", \
     "bench/results/cpu2_202612_kv_retrieval.csv" skip 1 using 2:(strcol(1) eq "adakv-expected-attention" ? 100*$6 : 1/0):(100*$7):(100*$8) with yerrorlines title "adakv-expected-attention", \
     "bench/results/cpu2_202612_kv_retrieval.csv" skip 1 using 2:(strcol(1) eq "minimax" ? 100*$6 : 1/0):(100*$7):(100*$8) with yerrorlines title "minimax", \
     "bench/results/cpu2_202612_kv_retrieval.csv" skip 1 using 2:(strcol(1) eq "minimax:abstain_heldout=0.03" ? 100*$6 : 1/0):(100*$7):(100*$8) with yerrorlines title "minimax:abstain_heldout=0.03"
set title "Worst decile of documents, mean, %"
plot "bench/results/cpu2_202612_kv_retrieval.csv" skip 1 using 2:(strcol(1) eq "full" ? 100*$9 : 1/0) with linespoints title "full", \
     "bench/results/cpu2_202612_kv_retrieval.csv" skip 1 using 2:(strcol(1) eq "window" ? 100*$9 : 1/0) with linespoints title "window", \
     "bench/results/cpu2_202612_kv_retrieval.csv" skip 1 using 2:(strcol(1) eq "h2o" ? 100*$9 : 1/0) with linespoints title "h2o", \
     "bench/results/cpu2_202612_kv_retrieval.csv" skip 1 using 2:(strcol(1) eq "snapkv" ? 100*$9 : 1/0) with linespoints title "snapkv", \
     "bench/results/cpu2_202612_kv_retrieval.csv" skip 1 using 2:(strcol(1) eq "tova" ? 100*$9 : 1/0) with linespoints title "tova", \
     "bench/results/cpu2_202612_kv_retrieval.csv" skip 1 using 2:(strcol(1) eq "expected-attention" ? 100*$9 : 1/0) with linespoints title "expected-attention", \
     "bench/results/cpu2_202612_kv_retrieval.csv" skip 1 using 2:(strcol(1) eq "adakv-h2o" ? 100*$9 : 1/0) with linespoints title "adakv-h2o", \
     "bench/results/cpu2_202612_kv_retrieval.csv" skip 1 using 2:(strcol(1) eq "adakv-snapkv" ? 100*$9 : 1/0) with linespoints title "adakv-snapkv", \
     "bench/results/cpu2_202612_kv_retrieval.csv" skip 1 using 2:(strcol(1) eq "adakv-tova" ? 100*$9 : 1/0) with linespoints title "adakv-tova", \
     "bench/results/cpu2_202612_kv_retrieval.csv" skip 1 using 2:(strcol(1) eq "adakv-expected-attention" ? 100*$9 : 1/0) with linespoints title "adakv-expected-attention", \
     "bench/results/cpu2_202612_kv_retrieval.csv" skip 1 using 2:(strcol(1) eq "minimax" ? 100*$9 : 1/0) with linespoints title "minimax", \
     "bench/results/cpu2_202612_kv_retrieval.csv" skip 1 using 2:(strcol(1) eq "minimax:abstain_heldout=0.03" ? 100*$9 : 1/0) with linespoints title "minimax:abstain_heldout=0.03"
unset multiplot
