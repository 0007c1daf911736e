package trainer

import (
	"fmt"
	"testing"

	"github.com/deepstates/dos/adam"
)

// TestFinalAfter: GPT-2's tensors in gpt.Config.Tensors order, three
// blocks: each block's twelve after its backward, ln_f's with the last
// block, the embeddings at the end.
func TestFinalAfter(t *testing.T) {
	c := Config{VocabSize: 256, NCtx: 16, NLayer: 3, NHead: 2, NEmbd: 8}
	var names []string
	for _, ts := range c.Tensors() {
		names = append(names, ts.Name)
	}
	blocks, rest := finalAfter(3)
	if len(blocks) != 3 {
		t.Fatalf("%d blocks", len(blocks))
	}
	for l, b := range blocks {
		want := 12
		if l == 2 {
			want = 14 // and ln_f's two
		}
		if len(b) != want {
			t.Errorf("block %d: %d tensors %v, want %d", l, len(b), b, want)
		}
		for _, i := range b {
			if n := names[i]; n != "ln_f.weight" && n != "ln_f.bias" && n[:len(fmt.Sprintf("h.%d.", l))] != fmt.Sprintf("h.%d.", l) {
				t.Errorf("block %d holds %s", l, n)
			}
		}
	}
	var got []string
	for _, i := range rest {
		got = append(got, names[i])
	}
	if fmt.Sprint(got) != "[wte.weight wpe.weight]" {
		t.Errorf("after the backward: %v", got)
	}
}

// TestMemoryBytesOverlap: on cuda the overlap's pinned gradients count 2
// bytes a parameter (every parameter: the schedule is not known yet), and
// --no-overlap takes them out.
func TestMemoryBytesOverlap(t *testing.T) {
	c := DefaultTrainConfig()
	c.Model = Config{VocabSize: 256, NCtx: 64, NLayer: 2, NHead: 2, NEmbd: 128}
	c.Device, c.WorkingDType, c.GradDType = "cuda", adam.BF16, adam.BF16
	with := c.MemoryBytes()
	c.NoOverlap = true
	without := c.MemoryBytes()
	if d := with - without; d != 2*float64(c.paramCount()) {
		t.Errorf("the overlap counts %g bytes, want 2 per parameter (%d)", d, 2*c.paramCount())
	}
}
