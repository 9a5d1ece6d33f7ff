"""The registry of exercises: one row per assignment, the region markers in the code carry its id.

An exercise is a region of the reference (`# exercise LL.N: title` ... `# end exercise`, regions.py)
plus what grades it: checks, each a pytest node id of the reference's tests/ with the rank counts to run
it at (none: one plain process), and a hint shown when it fails. Every check must fail on the stub and
pass on the reference (`make course-selftest` proves it for every row). Graded by exactness, bytes and
schedule properties, never by time. Lesson ids are the lesson files' numbers (LL of lessons/LL_*.md).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Check:
    node: str  # pytest node id, relative to the project root
    hint: str  # shown when the check fails: what the failure most likely means
    ranks: tuple[int, ...] = ()  # mpiexec -n K for each K; () = one plain process


@dataclass(frozen=True)
class Exercise:
    id: str  # LL.N
    title: str
    section: str  # the lesson's section (its heading) that explains what to write
    difficulty: int  # 1 one rule, 2 a function, 3 a technique
    checks: tuple[Check, ...]

    @property
    def lesson(self) -> str:
        return self.id.split(".")[0]


def stub_message(exercise: Exercise) -> str:
    return (f"exercise {exercise.id} (lesson {exercise.lesson}, section '{exercise.section}'): "
            f"{exercise.title}")


T = "tests/"

_ROWS = (
    Exercise("01.1", "the backward of softmax", "Checking a gradient", 1, (
        Check(T + "core/test_functional.py::test_softmax_and_log_softmax[softmax]",
              "the gradient differs from central differences: with y = softmax(x), "
              "dx = y * (g - sum(g * y)) along the axis"),)),
    Exercise("01.2", "the backward of layer norm", "Checking a gradient", 2, (
        Check(T + "core/test_functional.py::test_layer_norm",
              "the gradient differs from central differences: dx = rstd * (gx - mean(gx) - xhat * "
              "mean(gx * xhat)) with gx = g * weight; dweight and dbias sum over every axis but the last"),)),
    Exercise("01.3", "recomputation: the backward that runs the forward again",
             "Recomputation: paying compute for activation memory", 2, (
        Check(T + "parallel/test_recompute.py::test_checkpoint_gives_the_gradients_of_the_plain_function",
              "the gradients differ from the plain function's: rebuild the inputs as Tensors that require "
              "what needs_input_grad says, run the function under enable_grad, back-propagate grad"),
        Check(T + "parallel/test_recompute.py::test_mlp_trains_like_one_process_with_full_recomputation",
              "training with --recompute full drifts from one process: the parameters' gradients must "
              "accumulate into their .grad once per backward, and the inputs' gradients be returned"),)),
    Exercise("02.1", "the ring reduce-scatter", "The code", 2, (
        Check(T + "distributed/test_collectives.py::test_ring_reduce_scatter",
              "shard c must end on rank c, summed in the ring's order (chunk c starts at rank c+1): in "
              "the lesson's step s = 1 .. N-1, rank r sends its partial sum of chunk r - s and adds its "
              "own piece to the arriving chunk r - s - 1 (mod N); after step N-1 that is chunk r. Right "
              "at 2 ranks but not 3 or 4: check the chunk indices mod N",
              (2, 3, 4)),
        Check(T + "distributed/test_collectives.py::test_ring_reduce_scatter_traffic_is_what_crossed_the_communicator",
              "the bytes are counted on the communicator itself: N - 1 point-to-point messages of one "
              "chunk each (ring.pass_right), no object methods and no MPI collective; each partial sum "
              "goes through wire.encode before it is sent and wire.decode after it arrives",
              (2, 3, 4)),
        Check(T + "distributed/test_collectives.py::test_ring_all_reduce",
              "the all-reduce is your reduce-scatter then the all-gather: check the reduce-scatter first",
              (4,)))),
    Exercise("02.2", "the ring all-gather", "Uneven sizes and the traffic ledger", 1, (
        Check(T + "distributed/test_collectives.py::test_ring_all_gather_of_uneven_shards",
              "each rank's shard must land at its offset (the cumulative sum of the counts before it); "
              "pass what you received on to the right, N - 1 times", (2, 3, 4)),
        Check(T + "distributed/test_collectives.py::test_ring_all_gather_traffic_is_what_crossed_the_communicator",
              "the bytes are counted on the communicator itself: N - 1 point-to-point messages, each the "
              "chunk received last (in the first step your own), no object methods and no MPI "
              "collective; every chunk, your own too, goes through wire.encode and wire.decode",
              (2, 3, 4)),
        Check(T + "distributed/test_collectives.py::test_ring_all_reduce",
              "the all-reduce is the reduce-scatter then your all-gather", (4,)))),
    Exercise("04.1", "ZeRO's model-state bytes per parameter, stage by stage", "The paper's table, from the planner",
             1, (
        Check(T + "memory/test_planner.py::test_paper_example_7_5b_on_64_ranks",
              "the ZeRO paper's example (7.5B parameters, N = 64, K = 12): 120 GB, 31.4 GB, 16.6 GB, 1.9 GB; "
              "stage 1 partitions the optimizer states, 2 also the gradients, 3 also the parameters"),
        Check(T + "memory/test_planner.py::test_formula_matches_a_per_rank_count",
              "the formula disagrees with counting each rank's bytes: a partitioned part costs 1/N of "
              "its bytes per parameter, a replicated one all of them"),
        Check(T + "parallel/test_zero.py::test_model_state_bytes_per_rank_are_the_planners_formula",
              "a real ZeRO run's parameter, gradient and optimizer bytes on each rank must be your "
              "formula's (to the padding): stage s partitions what stages 1..s name, over the N ranks of "
              "this run", (2,)))),
    Exercise("06.1", "the 1F1B schedule builder", "1F1B: the same bubble, activations for K micro-batches", 2, (
        Check(T + "parallel/test_schedules.py::test_gpipe_holds_m_microbatches_1f1b_at_most_k",
              "stage s must hold at most K - s micro-batches: K - s - 1 warm-up forwards, then one "
              "forward and one backward in turn, then the remaining backwards"),
        Check(T + "parallel/test_schedules.py::test_simulated_bubble_is_the_formula",
              "the bubble must be GPipe's (K-1)/(M+K-1): a stage that waits longer runs an action "
              "before its input can have arrived, or leaves one out"),
        Check(T + "parallel/test_schedules.py::test_timeline_runs_each_list_in_order_after_its_inputs",
              "every stage lists F0..F(M-1) and B0..B(M-1) exactly once, each backward after its forward"),
        Check(T + "parallel/test_pipeline.py::test_activations_held_are_the_microbatches_in_flight",
              "memory is read from the activations a real pipeline run holds: stage s of 1F1B must peak at "
              "min(K - s, M) micro-batches' activations, neither more (GPipe's M) nor fewer; the warm-up is "
              "K - s - 1 forwards", (2,)),
        Check(T + "parallel/test_pipeline.py::test_pipeline_trains_to_the_single_process_losses_and_weights",
              "a pipeline run with your 1F1B must train to one process's losses and weights: every stage "
              "runs each micro-batch's forward and backward exactly once, each backward after its forward", (2,)))),
    Exercise("06.2", "the interleaved 1F1B schedule builder", "Interleaved 1F1B: V chunks per rank", 3, (
        Check(T + "parallel/test_schedules_beyond.py::test_interleaved_megatron_order_k2_m2_v2",
              "Megatron's order for K = 2, M = 2, V = 2 is written out in the test: compare yours step by step"),
        Check(T + "parallel/test_schedules_beyond.py::test_interleaved_bubble_shrinks_by_v",
              "the bubble must be 1F1B's divided by V: forward step k is micro-batch (k // KV)·K + k % K "
              "through chunk (k // K) % V; the backward goes through the chunks in reverse"),
        Check(T + "parallel/test_schedules_beyond.py::test_interleaved_first_rank_holds_k_plus_k_minus_1_over_v",
              "rank s runs 2(K - s - 1) + (V - 1)·K warm-up forwards, no more"),
        Check(T + "parallel/test_pipeline_schedules.py::test_schedules_train_to_the_single_process_result",
              "a pipeline run with your interleaved schedule must train to one process's losses and "
              "weights, sending 2V - 1 or 2V activations and gradients per micro-batch: every (micro-batch, "
              "chunk) forward and backward exactly once", (2,)))),
    Exercise("08.1", "the chunk tensor's state machine", "The state machine of a tensor", 1, (
        Check(T + "memory/test_chunks.py::test_exactly_the_drawn_transitions_are_legal_and_any_other_is_an_error",
              "a move not in LEGAL_TRANSITIONS must raise IllegalTransition (naming the tensor), "
              "a legal one must change the tensor's state"),
        Check(T + "memory/test_chunks.py::test_a_tensor_goes_round_the_whole_cycle_in_forward_and_backward",
              "after a legal transition the tensor must be in the new state"),
        Check(T + "memory/test_chunks.py::test_one_rank_trains_to_the_reference_and_leaves_every_tensor_free[none]",
              "chunked ZeRO-3 must train as one process does and end with every tensor FREE: check the move "
              "against the tensor's state before you change it"))),
    Exercise("08.2", "the eviction policy: Belady's OPT and LRU", "Which block goes: LRU or OPT", 2, (
        Check(T + "memory/test_offload.py::test_lru_thrashes_on_a_loop_one_longer_than_the_device_and_opt_does_not",
              "LRU evicts the block used least recently (last_used); OPT the one whose next use "
              "(next_use) is furthest away"),
        Check(T + "memory/test_offload.py::test_opt_moves_no_more_than_lru_on_any_repeated_trace",
              "Belady's OPT is optimal: it never moves more bytes than LRU; break its ties by recency"),
        Check(T + "memory/test_offload.py::test_with_prefetch_in_training_opt_still_moves_no_more_than_lru",
              "the bytes a real offloaded training run moves: OPT (the block whose next use is furthest "
              "away) must move no more than LRU"))),
    Exercise("09.1", "bf16 rounding to nearest, ties to even", "Emulating bf16 in four lines", 1, (
        Check(T + "precision/test_precision.py::test_bf16_named_cases",
              "bf16 is the top 16 bits of a float32: add 0x7FFF plus the lowest kept bit, then shift "
              "right by 16 (a tie goes to the even neighbour; a carry may reach infinity)"),
        Check(T + "precision/test_precision.py::test_bf16_matches_reference_near_ties",
              "a value exactly halfway between two bf16 numbers must round to the one with an even "
              "last bit"),)),
    Exercise("09.2", "the dynamic loss scaler's update", "Loss scaling: sliding fp16's window", 1, (
        Check(T + "precision/test_precision_scaler.py::test_update_follows_backoff_and_growth",
              "after an overflow multiply the scale by backoff_factor and restart the count; after "
              "growth_interval clean steps in a row multiply it by growth_factor"),
        Check(T + "precision/test_precision_scaler.py::test_growth_stops_below_fp32_infinity",
              "never grow the scale past float32's largest finite value"),
        Check(T + "precision/test_mixed_precision.py::test_the_scaler_skips_overflowing_steps_halves_and_grows_after_clean_ones",
              "an fp16 training run whose gradients overflow: each overflow skips the step and halves the "
              "scale, and only growth_interval clean steps in a row, counted from the last overflow, double "
              "it"))),
    Exercise("10.1", "the fusion pass", "The fusion rule", 3, (
        Check(T + "fusion/test_fusion_run.py::test_fusion_plan_ends_kernels_at_shared_values_roots_and_reductions",
              "a value is materialised (ends a kernel) when it is a leaf, a reduction, a root, or read by "
              "more than one node; everything else is computed inside the kernel that reads it"),
        Check(T + "fusion/test_fusion_run.py::test_chain_of_eight_is_one_kernel_and_moves_seven_times_less",
              "a chain of elementwise ops with no shared values must be one kernel"),
        Check(T + "fusion/test_fusion_props.py::test_random_elementwise_graphs_fused_equal_eager_bitwise",
              "fused must equal eager bit for bit: each kernel lists its members in topological order "
              "and reads only materialised inputs"),
        Check(T + "fusion/test_fusion_training.py::test_train_fused_gives_the_same_losses_and_weights_bit_for_bit",
              "training with --fused (GELU and AdamW through your plan) must give the plain run's losses "
              "and weights bit for bit: every root is materialised, and each kernel computes what eager "
              "does"))),
    Exercise("03.1", "buckets: parameters grouped last first under a cap", "Buckets: fewer, larger messages", 1, (
        Check(T + "parallel/test_data_parallel.py::test_buckets_take_every_parameter_once_last_first_within_the_cap",
              "walk the parameters last first (backward produces their gradients in that order); close a "
              "bucket when the next parameter would pass the cap or has another dtype; one too large for "
              "any bucket gets its own"),
        Check(T + "parallel/test_data_parallel.py::test_the_ledger_shows_the_bucket_count_and_accumulation_does_not_add_messages",
              "the ledger counts one all-reduce per bucket per step: too many buckets, or too few?", (2,)),
        Check(T + "parallel/test_data_parallel.py::test_ddp_trains_to_the_single_process_losses_and_weights",
              "dp differs from one process: a gradient in no bucket is never all-reduced, so each replica "
              "steps on its own part of the batch; every parameter goes in exactly one bucket, one larger than "
              "the cap too", (2,)))),
    Exercise("04.2", "the ZeRO-1 step: reduce-scatter, update the shard, all-gather",
             "The three stages: who holds what", 2, (
        Check(T + "parallel/test_zero.py::test_one_rank_trains_to_the_reference_and_holds_the_formulas_bytes[1]",
              "synchronize_gradients, per unit: flatten the gradients, reduce-scatter them into "
              "unit.grad_shard (each rank gets the sum of its shard; buffer_meter counts it until "
              "release_gradients); apply_optimizer, per unit: update only this rank's shard of the "
              "parameters, then all-gather the parameters"),
        Check(T + "parallel/test_zero.py::test_bytes_per_step_are_two_or_three_times_n_minus_one_over_n_of_the_model[1]",
              "ZeRO-1 sends what DDP sends, 2(N-1)/N of the model per step: one reduce-scatter and one "
              "all-gather of each unit's padded flat buffer", (2,)),
        Check(T + "parallel/test_zero.py::test_zero_trains_to_the_single_process_losses_and_weights",
              "ZeRO must train to one process's losses and weights: each rank's shard of the gradient is the "
              "sum over the ranks (the loss is already normalised by the global batch, so not the mean), and "
              "every rank's updated shard comes back in rank order", (2,)))),
    Exercise("04.3", "ZeRO-3: gather a unit's parameters, release them",
             "How stage 3 frees parameters that backward still needs", 2, (
        Check(T + "parallel/test_zero.py::test_stage3_frees_every_parameter_outside_its_units_forward_and_backward",
              "gather: all-gather the shard into unit.flat (or wait for the prefetch) and point the "
              "parameters at it; release: give its bytes back to buffer_meter, drop unit.flat, and leave "
              "every parameter the empty array unit.freed"),
        Check(T + "parallel/test_zero.py::test_one_rank_trains_to_the_reference_and_holds_the_formulas_bytes[3]",
              "one rank of ZeRO-3 must train as the plain model does: the forward and backward must run on "
              "the gathered parameters (what all_gather returns), not on a buffer of your own"),
        Check(T + "parallel/test_zero.py::test_zero_trains_to_the_single_process_losses_and_weights",
              "ZeRO-3 must train to one process's losses and weights: the parameters a unit computes with "
              "are what all_gather returned, every rank's shard in rank order", (2,)),
        Check(T + "parallel/test_zero.py::test_stage3_gathered_buffers_are_dead_after_release_and_the_meter_saw_each",
              "memory is read from the live buffers: after a release nothing may still refer to the "
              "gathered buffer (no list of them, no copy kept), and buffer_meter must grow by its bytes "
              "at the gather and shrink by them at the release", (2,)),
        Check(T + "parallel/test_zero.py::test_stages_2_and_3_hold_one_units_full_gradients_at_a_time[3]",
              "the peak of buffer_meter must be one unit's gradients, their flat copy and its gathered "
              "parameters: count each gather in buffer_meter and release it when the unit is done", (2,)),
        Check(T + "parallel/test_zero.py::test_stage3_sends_one_and_a_half_times_stage1",
              "stage 3 gathers each unit twice (forward and backward) and reduce-scatters once: 1.5x "
              "stage 1's bytes; a unit already whole must not be gathered again", (2,)))),
    Exercise("05.1", "f and g: the communication of column- and row-parallel layers",
             "f and g: the communication as autograd functions", 1, (
        Check(T + "parallel/test_tensor_parallel.py::test_f_and_g_are_conjugate",
              "f is the identity forward and an all-reduce backward; g is the all-reduce forward and the "
              "identity backward", (2,)),
        Check(T + "parallel/test_tensor_parallel.py::test_column_parallel_linear",
              "a column-parallel layer's input gradient is the sum over ranks of the partial ones: f's "
              "backward", (2,)),
        Check(T + "parallel/test_tensor_parallel.py::test_row_parallel_linear",
              "a row-parallel layer's output is the sum over ranks of the partial products: g's forward",
              (2, 3)),
        Check(T + "parallel/test_tensor_parallel.py::test_gpt_trains_like_the_single_process_gpt",
              "the tensor-parallel GPT must train as the plain one does: f's backward and g's forward each "
              "return the sum over the ranks (what all_reduce returns; it does not change its argument)", (2,)))),
    Exercise("05.2", "vocab-parallel cross-entropy: three all-reduces of N numbers",
             "The vocabulary: embedding and loss", 3, (
        Check(T + "parallel/test_tensor_parallel.py::test_vocab_parallel_cross_entropy",
              "mask the padding columns with -inf; all-reduce (max) the row maxima, all-reduce (sum) the "
              "target's shifted logit (found on one rank, 0 elsewhere) and the sums of exp; save "
              "softmax for backward, with the rows and local columns of the targets this rank holds",
              (2, 3)),
        Check(T + "parallel/test_tensor_parallel.py::test_gpt_trains_like_the_single_process_gpt",
              "the tensor-parallel GPT must train as the plain one does: the loss's backward is softmax "
              "minus one-hot, and the softmax it saves divides by the sum of exp over every rank's columns", (2,)))),
    Exercise("13.1", "the online softmax: one block of scores at a time",
             "The online softmax: softmax over blocks that arrive one at a time", 2, (
        Check(T + "parallel/test_context.py::test_the_online_softmax_over_blocks_is_the_softmax_of_the_whole_row",
              "keep the running maximum m, total l and output o: with m' = max(m, max s), rescale l and o "
              "by exp(m - m'), then add sum(exp(s - m')) and exp(s - m') @ v"),
        Check(T + "parallel/test_context.py::test_the_online_softmax_stays_finite_and_exact_for_large_scores",
              "scores near 800 overflow exp(): subtract the running maximum before exp, never the raw "
              "scores; and shift by the maximum over every block so far, not the block's own (a block "
              "of +400 then one of -400), rescaling what was summed when the maximum grows"),
        Check(T + "parallel/test_context.py::test_ring_attention_on_one_rank_is_causal_attention_and_its_gradients",
              "ring attention on one rank is causal attention: the online softmax must agree to rounding"),
        Check(T + "parallel/test_context.py::test_random_layouts_with_cp_train_like_one_process",
              "a context-parallel run must train like one process: the blocks of keys arrive from the other "
              "ranks in any order, so the running maximum, total and output must not depend on it", (2,)))),
    Exercise("15.1", "top-k routing with a capacity per expert", "Capacity, and why per sequence", 2, (
        Check(T + "parallel/test_experts.py::test_layer_matches_the_reference_written_with_loops",
              "each token's k best experts, best first, ties to the lower index (a stable argsort of "
              "-probs); counts per expert and sequence before dropping"),
        Check(T + "parallel/test_experts.py::test_over_capacity_tokens_are_dropped_in_position_order",
              "an expert's queue for a sequence fills in position order (then choice order): the "
              "assignments at place >= capacity are dropped"),
        Check(T + "parallel/test_experts.py::test_data_parallel_moe_trains_like_one_process",
              "data-parallel MoE must train like one process: capacity is per sequence, so each rank's "
              "routing of its own sequences must be what one process does for them; count places within a "
              "sequence, not across the batch", (2,)))),
    Exercise("07.1", "the process grid: a rank and its coordinates", "The grid", 1, (
        Check(T + "distributed/test_comm.py::test_single_rank_grid_and_its_errors",
              "coords_of(rank) is (dp, pp, tp, cp) with tp varying fastest, then cp, then pp, then dp; "
              "rank_of is its inverse"),
        Check(T + "distributed/test_comm.py::test_coordinates_of_every_rank_for_every_four_way_layout",
              "count the ranks as nested loops over dp, pp, cp, tp with tp innermost: coords_of(rank) is "
              "(dp, pp, tp, cp) (note the order) and rank_of its inverse, with cp a coordinate like the "
              "others"),
        Check(T + "distributed/test_comm.py::test_process_grid_for_every_factorisation",
              "rank = ((dp_rank * pp + pp_rank) * cp + cp_rank) * tp + tp_rank: tensor-parallel partners "
              "must be neighbours, and each sub-communicator the ranks that differ in one coordinate",
              (4,)),
        Check(T + "parallel/test_context.py::test_cp_with_each_dimension_trains_like_one_process",
              "training on 4 ranks with cp beside dp, pp, tp and ZeRO must be one process's: a rank "
              "computes with the partners your coordinates give it, so a swapped coordinate puts the wrong "
              "ranks in a group", (4,)))),
    Exercise("12.1", "resharding: a tensor assembled from the pieces of any layout",
             "Reading it back in another layout: resharding", 2, (
        Check(T + "checkpoint/test_checkpoint.py::test_pieces_of_any_layout_assemble_to_the_full_tensor",
              "first put each tensor-parallel shard together from its flat ranges (a ZeRO slice may "
              "straddle rows), then place the shards along their axis, then cut the padding off"),
        Check(T + "checkpoint/test_checkpoint.py::test_resume_on_one_process_is_bitwise_the_uninterrupted_run[1-gpt-adamw]",
              "a resumed run must be bitwise the uninterrupted one: every piece of the saved state "
              "lands where it was, in its dtype"),
        Check(T + "checkpoint/test_checkpoint.py::test_resume_in_another_layout_trains_like_one_process",
              "a run saved at one layout and resumed at another must train like one process: every "
              "tensor-parallel shard goes at its own offset along its axis, each ZeRO slice at its flat "
              "range within the shard, and the padding is cut off the end", (2,)))),
    Exercise("14.1", "the GPT's parameter count from its shape", "FLOPs from the shape", 1, (
        Check(T + "simulate/test_simulate.py::test_parameter_count_is_the_real_models",
              "count minipar's GPT: token and position embeddings, 12h² + 12h per block (the key has no "
              "bias), the final LayerNorm, and an untied lm_head without bias"),
        Check(T + "simulate/test_simulate.py::test_memory_equals_the_ledger_of_a_real_run",
              "the simulator's model-state memory is the parameter count times the bytes per "
              "parameter: it must equal what a real run's ledger holds"),)),
    Exercise("14.2", "the alpha-beta time of a ring collective", "From FLOPs to seconds (minipar/simulate/step.py)",
             1, (
        Check(T + "simulate/test_simulate.py::test_ring_time_is_comms_charge_over_the_bandwidth_plus_its_messages",
              "time = messages x latency + the bytes one rank sends / bandwidth: 2(N-1) messages and "
              "2(N-1)/N of the payload for an all-reduce, N-1 and (N-1)/N for the others; 0 on one rank"),
        Check(T + "simulate/test_simulate.py::test_table1_first_row_is_the_calibration_and_the_rest_within_30_percent",
              "Megatron's Table 1 is predicted within 30% once the ring times are right"),)),
    Exercise("05.3", "sequence parallelism: all-gather and reduce-scatter along the sequence",
             "Sequence parallelism: the replicated regions, cut along the sequence", 2, (
        Check(T + "parallel/test_sequence.py::test_gather_and_reduce_scatter_are_adjoint",
              "the gather puts every rank's (b, s/t, h) piece in rank order along the sequence axis; the "
              "reduce-scatter keeps this rank's s/t positions of the sum; make the sequence the leading "
              "axis first, so that each rank's positions are one contiguous shard", (2, 4)),
        Check(T + "parallel/test_sequence.py::test_tp_traffic_is_tensor_parallelisms_plus_the_replicated_gradients",
              "an all-gather and a reduce-scatter of the activations cost together what tensor "
              "parallelism's all-reduce did: one collective each way, no more", (2,)),
        Check(T + "parallel/test_sequence.py::test_sequence_parallel_trains_like_one_process",
              "a run with --sp must train like one process: the gather puts every rank's piece of the "
              "sequence at its positions, the reduce-scatter gives this rank the sum at its own positions", (2,)))),
    Exercise("06.3", "cutting the model into balanced stages", "Cutting the model into stages", 3, (
        Check(T + "parallel/test_pipeline.py::test_partition_is_contiguous_nonempty_and_balanced",
              "the costliest stage sets the pipeline's pace: minimise it, then the next costliest, ... "
              "(dynamic programming over (stages, units covered), comparing sorted stage costs); ties to "
              "the earliest cut, so every rank cuts alike"),
        Check(T + "parallel/test_pipeline.py::test_embedding_and_head_count_as_blocks",
              "the test's cuts are written out: with a large vocabulary the embedding and the head are "
              "the costliest units and get a stage each; among equal cuts take the earliest"),)),
    Exercise("03.2", "the bucketed all-reduce of the gradients", "The code", 1, (
        Check(T + "parallel/test_data_parallel.py::test_one_bucket_sends_exactly_two_n_minus_one_over_n_of_the_gradient_bytes",
              "one bucket is one all-reduce of its gradients flattened into one buffer: 2(N-1)/N of "
              "their bytes in 2(N-1) messages; give each parameter back its slice, in its shape", (2,)),
        Check(T + "parallel/test_data_parallel.py::test_ddp_trains_to_the_single_process_losses_and_weights",
              "dp differs from one process: the gradients are summed over the replicas, not averaged "
              "(the loss is already normalised by the global batch), and every parameter of the "
              "bucket gets its own slice of the sum", (2,)))),
    Exercise("06.4", "the pipeline executor's point-to-point send and receive",
             "The executor: one loop runs any schedule", 2, (
        Check(T + "parallel/test_overlap.py::test_a_pipeline_with_receives_posted_early_trains_like_one_process_and_sends_the_same",
              "send: start a non-blocking send (comm.isend) and keep its request until it completes; "
              "receive: wait for the receive posted early for (source, tag) if there is one, else "
              "receive now (comm.recv); a stage must never block in a send its neighbour waits on",
              (2, 4)),)),
)

EXERCISES: tuple[Exercise, ...] = tuple(sorted(_ROWS, key=lambda e: tuple(map(int, e.id.split(".")))))
BY_ID = {exercise.id: exercise for exercise in EXERCISES}
