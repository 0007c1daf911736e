package trainer

import (
	"math"
	"testing"
)

func TestLoaderSequentialAndWrap(t *testing.T) {
	data := []byte("abcdefghijklmnopqrstuvwxyz")
	l, err := NewLoader(data, 2, 4)
	if err != nil {
		t.Fatal(err)
	}
	in, tg := make([]int32, 8), make([]int32, 8)
	l.Next(in, tg)
	if string(bytesOf(in)) != "abcdefgh" || string(bytesOf(tg)) != "bcdefghi" || l.Pos != 8 {
		t.Fatalf("first batch %q -> %q, pos %d", bytesOf(in), bytesOf(tg), l.Pos)
	}
	l.Next(in, tg)
	l.Next(in, tg) // pos 16: rows at 16..23, target up to 24: fits
	if string(bytesOf(in)) != "qrstuvwx" || l.Pos != 24 {
		t.Fatalf("third batch %q, pos %d", bytesOf(in), l.Pos)
	}
	l.Next(in, tg) // 24+8+1 > 26: wraps to 0
	if string(bytesOf(in)) != "abcdefgh" || l.Pos != 8 {
		t.Fatalf("after wrap %q, pos %d", bytesOf(in), l.Pos)
	}
	// A position from a checkpoint resumes the stream exactly.
	l2, _ := NewLoader(data, 2, 4)
	if err := l2.SetPos(l.Pos); err != nil {
		t.Fatal(err)
	}
	a, b := make([]int32, 8), make([]int32, 8)
	l.Next(in, tg)
	l2.Next(a, b)
	if string(bytesOf(in)) != string(bytesOf(a)) {
		t.Fatal("resumed loader differs")
	}
	if err := l2.SetPos(-1); err == nil {
		t.Error("negative position accepted")
	}
	if _, err := NewLoader([]byte("ab"), 1, 4); err == nil {
		t.Error("data shorter than a sequence accepted")
	}
}

func bytesOf(v []int32) []byte {
	b := make([]byte, len(v))
	for i, x := range v {
		b[i] = byte(x)
	}
	return b
}

func TestDatasetSplit(t *testing.T) {
	text := make([]byte, 1000)
	d, err := NewDataset(text, 0.1, 64)
	if err != nil || len(d.Train) != 900 || len(d.Val) != 100 {
		t.Fatalf("split %d/%d, %v", len(d.Train), len(d.Val), err)
	}
	if _, err := NewDataset(text, 0.01, 64); err == nil {
		t.Error("a validation part shorter than a sequence accepted")
	}
	if _, err := NewDataset(text, 0, 64); err == nil {
		t.Error("valFraction 0 accepted")
	}
}

func TestLRSchedule(t *testing.T) {
	c := DefaultTrainConfig()
	c.LR, c.MinLRRatio, c.WarmupSteps, c.Steps, c.DecaySteps = 1, 0.1, 10, 100, 0
	for _, tc := range []struct {
		it   int
		want float64
	}{{1, 0.1}, {10, 1}, {55, 0.55}, {100, 0.1}, {200, 0.1}} {
		if got := c.LRAt(tc.it); math.Abs(got-tc.want) > 1e-12 {
			t.Errorf("LRAt(%d) = %v, want %v", tc.it, got, tc.want)
		}
	}
	c.DecaySteps = 190
	if got := c.LRAt(100); math.Abs(got-0.55) > 1e-12 {
		t.Errorf("with decay_steps 190, LRAt(100) = %v, want 0.55", got)
	}
}
