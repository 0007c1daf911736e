package trainer

import (
	"path/filepath"
	"syscall"
	"testing"
	"time"
)

// TestReadTokensFIFO: a FIFO is refused as not a regular file at once
// (opening it first used to wait for a writer: dos train --data FIFO
// hung).
func TestReadTokensFIFO(t *testing.T) {
	p := filepath.Join(t.TempDir(), "fifo.bin")
	if err := syscall.Mkfifo(p, 0o644); err != nil {
		t.Skip(err)
	}
	done := make(chan error, 1)
	go func() { _, _, err := ReadTokens(p, 256); done <- err }()
	select {
	case err := <-done:
		if err == nil {
			t.Fatal("ReadTokens of a FIFO: no error")
		}
	case <-time.After(3 * time.Second):
		t.Fatal("ReadTokens of a FIFO blocked for 3 s (os.Open waits for a writer) instead of refusing a non-regular file")
	}
}

// TestLoaderPosAtWrap: the --log-json record's pos is where the batch was
// read, also when Loader (the --text path) wraps to 0 inside Next (the
// position taken before Next named where it was not read).
func TestLoaderPosAtWrap(t *testing.T) {
	data := make([]byte, 180)
	for i := range data {
		data[i] = byte(i)
	}
	l, err := NewLoader(data, 2, 16)
	if err != nil {
		t.Fatal(err)
	}
	in, tg := make([]int32, 32), make([]int32, 32)
	for i := range 8 {
		l.Next(in, tg)
		pos := l.lastStart()                 // what Run records as "pos"
		if got := int64(in[0]); got != pos { // data[i] == i: the first input is the position read
			t.Errorf("batch %d: recorded pos %d, but Next read from %d", i+1, pos, got)
		}
	}
}

// TestResumeOtherSplit: a run on --data A (validating on its last 10 %)
// does not resume on --data A[:4000] --val-data A[4000:], the same tokens
// split another way (the CRC of the training then the validation tokens is
// the same; the training count is not).
func TestResumeOtherSplit(t *testing.T) {
	setMemAvailable(t, 0, false)
	all := make([]uint16, 5000)
	for i := range all {
		all[i] = uint16(i * 7 % 256)
	}
	c := DefaultTrainConfig()
	c.Model.NLayer, c.Model.NEmbd, c.Model.NHead, c.Model.NCtx = 1, 8, 1, 16
	c.Batch, c.Steps, c.SampleBytes, c.CkptDir, c.CkptSync = 2, 2, 0, t.TempDir(), true
	tr, err := NewTokens(c, all, nil, nil)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := tr.Run(); err != nil {
		t.Fatal(err)
	}
	tr.Close()
	c.Resume, c.Steps = true, 3
	tr, err = NewTokens(c, all[:4000], all[4000:], nil)
	if err == nil {
		tr.Close()
		t.Errorf("resume on another train/validation split of the same tokens was accepted")
	}
}
