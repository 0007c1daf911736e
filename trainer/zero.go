package trainer

import (
	"encoding/json"
	"fmt"

	"github.com/deepstates/dos/checkpoint"
	"github.com/deepstates/dos/offload"
)

// ZeRO-3 data parallelism in one process (TrainConfig.GPUs > 1, on the host
// or --device sim): rank r of N holds piece r of every tensor (its
// ceil(numel/N) elements from r·ceil(numel/N): the last pieces shorter, or
// empty for a tensor of fewer than (N-1)·ceil(numel/N) elements) and
// that piece's optimizer state in its own offload.Optimizer, with its own
// device and its share of the CPU workers. Each iteration, every rank, on
// its own goroutine:
//
//  1. all-gathers each tensor's working copy from the ranks' pieces
//     (comm.AllGather) into its replica of the model's parameters;
//  2. runs forward and backward on its B/N rows of the global batch;
//  3. reduce-scatters each tensor's gradient (comm.ReduceScatter, Avg: the
//     gradient of the mean loss over the global batch) into its piece;
//  4. steps its optimizer, the gradient norm and the non-finite check made
//     global by an all-reduce of the sums of squares (offload.StepArgs
//     Reduce), so that every rank clips and skips alike.
//
// The loss reported is the ranks' mean (an all-reduce). The communicator is
// comm.Local (hostGathered); on GPUs the same collectives run over NCCL
// (zerogpu.go). The
// trajectory matches one rank's with the same global batch within float
// tolerance: the ranks' partial sums associate differently
// (TestZeROMatchesOneRank).

// shardParams returns rank r's pieces of c's tensors as the optimizer's
// parameters: each tensor's name, one dimension of its piece's length.
func shardParams(c Config, n, r int) []offload.Param {
	ts := c.Tensors()
	ps := make([]offload.Param, len(ts))
	for i, t := range ts {
		lo, hi := pieceOf(t.Numel(), n, r)
		ps[i] = offload.Param{Name: t.Name, Shape: []int{hi - lo}}
	}
	return ps
}

// pieceOf returns the elements [lo, hi) of a tensor of numel elements that
// rank r of n holds.
func pieceOf(numel, n, r int) (lo, hi int) {
	p := (numel + n - 1) / n
	return min(r*p, numel), min((r+1)*p, numel)
}

// rankObject is the object a rank's checkpoint records beside the
// trainer's: which piece of which job it holds, so that a rank root
// restored from another rank's files, or a rank root taken for a job's,
// is refused by name instead of loading another rank's pieces.
type rankObject struct {
	Rank  int `json:"rank"`
	Ranks int `json:"ranks"`
}

// rankObjectName is its name among the checkpoint's objects.
const rankObjectName = "zero"

// rankObjects returns objects with rank r of n's rankObject added.
func rankObjects(objects map[string]any, r, n int) map[string]any {
	out := make(map[string]any, len(objects)+1)
	for k, v := range objects {
		out[k] = v
	}
	out[rankObjectName] = rankObject{Rank: r, Ranks: n}
	return out
}

// CheckpointRank returns which rank of a job of ranks (dos train --gpus)
// the checkpoint c's pieces are, from the record dos train writes beside
// them (ok false for a checkpoint without it: a single rank's, or older).
// The manifest's rank and world size are the rank root's own, 0 of 1.
func CheckpointRank(c *checkpoint.Checkpoint) (rank, ranks int, ok bool) {
	var ro rankObject
	if err := c.Object(rankObjectName, &ro); err != nil {
		return 0, 0, false
	}
	return ro.Rank, ro.Ranks, true
}

// checkRank returns an error wrapping checkpoint.ErrCorrupt when the
// checkpoint whose objects are objs records another rank than r of n
// (rankObject); checkpoints without the record (older ones) pass.
func checkRank(objs map[string]json.RawMessage, dir string, r, n int) error {
	raw, ok := objs[rankObjectName]
	if !ok {
		return nil
	}
	var ro rankObject
	if err := json.Unmarshal(raw, &ro); err != nil {
		return fmt.Errorf("%s: object %q: %v: %w", dir, rankObjectName, err, checkpoint.ErrCorrupt)
	}
	if ro.Rank != r || ro.Ranks != n {
		return fmt.Errorf("%s holds rank %d's pieces of a job of %d ranks, where rank %d of %d is expected (rank directories moved or copied?): %w", dir, ro.Rank, ro.Ranks, r, n, checkpoint.ErrWrongRank)
	}
	return nil
}
