package comm

import (
	"errors"
	"fmt"
	"math"
	"strings"
	"sync"
	"testing"
)

// each runs f on every rank of a new n-rank communicator, one goroutine
// per rank, and returns each rank's error.
func each(n int, f func(c *Local) error) []error {
	ends := NewLocal(n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	for r, c := range ends {
		wg.Add(1)
		go func() {
			defer wg.Done()
			errs[r] = f(c)
		}()
	}
	wg.Wait()
	return errs
}

func f32s(xs ...float32) []byte {
	b := make([]byte, 4*len(xs))
	for i, x := range xs {
		put(b, F32, i, float64(x))
	}
	return b
}

func unf32(b []byte) []float32 {
	xs := make([]float32, len(b)/4)
	for i := range xs {
		xs[i] = float32(get(b, F32, i))
	}
	return xs
}

func bf16s(xs ...float32) []byte {
	b := make([]byte, 2*len(xs))
	for i, x := range xs {
		put(b, BF16, i, float64(x))
	}
	return b
}

// value is rank r's element i in the tests' buffers: distinct per rank
// and element, exact in bf16.
func value(r, i int) float64 { return float64(r*32+i) * 0.25 }

// TestLocalCollectives checks every collective's result against a serial
// reference (sums in rank order, in float32), on 1 to 4 ranks, for fp32
// and bf16, out of place and in place (AllGather's send as its own segment
// of recv, ReduceScatter's recv as its own segment of send, AllReduce's
// recv as send).
func TestLocalCollectives(t *testing.T) {
	const n = 5 // elements per rank's segment
	for size := 1; size <= 4; size++ {
		for _, dt := range []DType{F32, BF16, F64} {
			for _, inPlace := range []bool{false, true} {
				t.Run(fmt.Sprintf("ranks=%d/%v/inplace=%t", size, dt, inPlace), func(t *testing.T) {
					es := int(dt.Size())
					mk := func(r, count int) []byte {
						b := make([]byte, es*count)
						for i := range count {
							put(b, dt, i, value(r, i))
						}
						return b
					}
					errs := each(size, func(c *Local) error {
						r := c.Rank()
						// AllGather.
						recv := make([]byte, es*n*size)
						send := mk(r, n)
						if inPlace {
							copy(recv[r*es*n:], send)
							send = recv[r*es*n : (r+1)*es*n]
						}
						if err := c.AllGather(send, recv, dt); err != nil {
							return err
						}
						for q := range size {
							for i := range n {
								if got, want := get(recv, dt, q*n+i), value(q, i); got != want {
									return fmt.Errorf("AllGather: rank %d element %d of rank %d: %v, want %v", r, i, q, got, want)
								}
							}
						}
						for _, op := range []Op{Sum, Avg} {
							// ReduceScatter.
							send := mk(r, n*size)
							rs := make([]byte, es*n)
							if inPlace {
								rs = send[r*es*n : (r+1)*es*n]
							}
							if err := c.ReduceScatter(send, rs, dt, op); err != nil {
								return err
							}
							for i := range n {
								want := refReduce(size, dt, op, r*n+i)
								if got := get(rs, dt, i); got != want {
									return fmt.Errorf("ReduceScatter %v: rank %d element %d: %v, want %v", op, r, i, got, want)
								}
							}
							// AllReduce.
							send = mk(r, n)
							ar := make([]byte, es*n)
							if inPlace {
								ar = send
							}
							if err := c.AllReduce(send, ar, dt, op); err != nil {
								return err
							}
							for i := range n {
								if got, want := get(ar, dt, i), refReduce(size, dt, op, i); got != want {
									return fmt.Errorf("AllReduce %v: rank %d element %d: %v, want %v", op, r, i, got, want)
								}
							}
						}
						// Broadcast from every root.
						for root := range size {
							buf := mk(r, n)
							if err := c.Broadcast(buf, root); err != nil {
								return err
							}
							for i := range n {
								if got, want := get(buf, dt, i), value(root, i); got != want {
									return fmt.Errorf("Broadcast from %d: rank %d element %d: %v, want %v", root, r, i, got, want)
								}
							}
						}
						return nil
					})
					for r, err := range errs {
						if err != nil {
							t.Errorf("rank %d: %v", r, err)
						}
					}
				})
			}
		}
	}
}

// refReduce is element i of the ranks' mk buffers reduced in rank order in
// float64 and rounded to dt.
func refReduce(size int, dt DType, op Op, i int) float64 {
	var x float64
	for r := range size {
		x += value(r, i)
	}
	if op == Avg {
		x /= float64(size)
	}
	b := make([]byte, dt.Size())
	put(b, dt, 0, x)
	return get(b, dt, 0)
}

// TestLocalRankOrder: reductions add in rank order, so every rank gets
// the same bits and the result does not depend on which goroutine ran
// first: 1 + 1e16 - 1e16 in float64 in that order is not 1, what the last
// rank first gives.
func TestLocalRankOrder(t *testing.T) {
	xs := []float64{1, 1e16, -1e16}
	want := (xs[0] + xs[1]) + xs[2]
	if want == 1 {
		t.Fatal("the values do not depend on the order")
	}
	for range 20 {
		got := make([]float64, 3)
		errs := each(3, func(c *Local) error {
			buf := make([]byte, 8)
			put(buf, F64, 0, xs[c.Rank()])
			if err := c.AllReduce(buf, buf, F64, Sum); err != nil {
				return err
			}
			got[c.Rank()] = get(buf, F64, 0)
			return nil
		})
		for r := range 3 {
			if errs[r] != nil {
				t.Fatal(errs[r])
			}
			if got[r] != want {
				t.Fatalf("rank %d: %v, want %v (rank order)", r, got[r], want)
			}
		}
	}
	// bf16: summed wider, rounded at the end: 1 + 2^-8 + 2^-8 is 1 + 2^-7
	// (bf16 has 7 fraction bits); adding in bf16 would round each 2^-8 away.
	errs := each(3, func(c *Local) error {
		x := []float64{1, 1.0 / 256, 1.0 / 256}[c.Rank()]
		buf := make([]byte, 2)
		put(buf, BF16, 0, x)
		if get(buf, BF16, 0) != x {
			return fmt.Errorf("%v is not exact in bf16", x)
		}
		if err := c.AllReduce(buf, buf, BF16, Sum); err != nil {
			return err
		}
		if got := get(buf, BF16, 0); got != 1+1.0/128 {
			return fmt.Errorf("bf16 sum %v, want %v", got, 1+1.0/128)
		}
		return nil
	})
	for r, err := range errs {
		if err != nil {
			t.Errorf("rank %d: %v", r, err)
		}
	}
}

// TestLocalMismatch: ranks that call different collectives, or the same
// with other counts, dtypes, reductions or roots, all get a MismatchError
// naming the first differing rank and both calls, and the communicator
// goes on working for the next collective.
func TestLocalMismatch(t *testing.T) {
	for _, tc := range []struct {
		name string
		odd  func(c *Local) error // rank 2's call; the others AllReduce 4 fp32 elements with Sum
		want string
	}{
		{"kind", func(c *Local) error { return c.AllGather(f32s(1), make([]byte, 12), F32) }, "rank 2 called AllGather of 1 float32"},
		{"count", func(c *Local) error { b := f32s(1, 2); return c.AllReduce(b, b, F32, Sum) }, "AllReduce (sum) of 2 float32"},
		{"dtype", func(c *Local) error { b := make([]byte, 16); return c.AllReduce(b, b, BF16, Sum) }, "AllReduce (sum) of 8 bfloat16"},
		{"op", func(c *Local) error { b := f32s(1, 2, 3, 4); return c.AllReduce(b, b, F32, Avg) }, "AllReduce (avg)"},
	} {
		t.Run(tc.name, func(t *testing.T) {
			errs := each(3, func(c *Local) error {
				var err error
				if c.Rank() == 2 {
					err = tc.odd(c)
				} else {
					b := f32s(1, 2, 3, 4)
					err = c.AllReduce(b, b, F32, Sum)
				}
				var me *MismatchError
				if !errors.As(err, &me) || me.Rank != 2 || me.Call != 0 || !strings.Contains(err.Error(), tc.want) {
					return fmt.Errorf("got %v, want a mismatch at rank 2 saying %q", err, tc.want)
				}
				// The next collective works.
				b := f32s(float32(c.Rank()))
				if err := c.AllReduce(b, b, F32, Sum); err != nil {
					return fmt.Errorf("after the mismatch: %v", err)
				}
				if got := unf32(b)[0]; got != 3 {
					return fmt.Errorf("after the mismatch: sum %v, want 3", got)
				}
				return nil
			})
			for r, err := range errs {
				if err != nil {
					t.Errorf("rank %d: %v", r, err)
				}
			}
		})
	}
	errs := each(2, func(c *Local) error {
		err := c.Broadcast(f32s(1), c.Rank())
		var me *MismatchError
		if !errors.As(err, &me) || !strings.Contains(err.Error(), "Broadcast of 4 bytes from rank 1") {
			return fmt.Errorf("broadcast from two roots: %v", err)
		}
		return nil
	})
	for r, err := range errs {
		if err != nil {
			t.Errorf("rank %d: %v", r, err)
		}
	}
}

// TestLocalAbortClose: a rank that aborts or closes stops the others'
// waiting (NCCL would hang) with ErrAborted (and the reason) or ErrClosed,
// now and on every later call.
func TestLocalAbortClose(t *testing.T) {
	for _, closing := range []bool{false, true} {
		ends := NewLocal(3)
		var wg sync.WaitGroup
		errs := make([]error, 2)
		for r := range 2 {
			wg.Add(1)
			go func() {
				defer wg.Done()
				b := f32s(1)
				errs[r] = ends[r].AllReduce(b, b, F32, Sum)
			}()
		}
		cause := errors.New("rank 2 ran out of memory")
		if closing {
			ends[2].Close()
		} else {
			ends[2].Abort(cause)
		}
		wg.Wait()
		want := ErrAborted
		if closing {
			want = ErrClosed
		}
		for r, err := range errs {
			if !errors.Is(err, want) || !closing && !strings.Contains(err.Error(), cause.Error()) {
				t.Errorf("closing=%t: rank %d: %v, want %v", closing, r, err, want)
			}
		}
		if err := ends[0].Broadcast(f32s(1), 0); !errors.Is(err, want) {
			t.Errorf("closing=%t: a later call: %v, want %v", closing, err, want)
		}
	}
}

// TestLocalBadInput: lengths that do not fit the ranks or the dtype, an
// unknown op or dtype and a root out of range are refused before the
// rendezvous (the other ranks are not involved).
func TestLocalBadInput(t *testing.T) {
	c := NewLocal(2)[0]
	for _, tc := range []struct {
		err  error
		want string
	}{
		{c.AllGather(f32s(1), make([]byte, 4), F32), "recv of 4 bytes for 2 ranks of 4"},
		{c.AllGather(make([]byte, 3), make([]byte, 6), F32), "3 bytes is not a whole number of float32"},
		{c.ReduceScatter(f32s(1, 2, 3), f32s(1), F32, Sum), "send of 12 bytes for 2 ranks of 4"},
		{c.ReduceScatter(f32s(1, 2), f32s(1), F32, Op(7)), "unknown Op(7)"},
		{c.AllReduce(f32s(1, 2), f32s(1), F32, Sum), "recv of 4 bytes for send of 8"},
		{c.AllReduce(f32s(1), f32s(1), DType(9), Sum), "unknown DType(9)"},
		{c.AllReduce(make([]byte, 12), make([]byte, 12), F64, Sum), "12 bytes is not a whole number of float64"},
		{c.Broadcast(f32s(1), 2), "root 2 of 2 ranks"},
		{c.Broadcast(f32s(1), -1), "root -1 of 2 ranks"},
	} {
		if tc.err == nil || !strings.Contains(tc.err.Error(), tc.want) {
			t.Errorf("got %v, want %q", tc.err, tc.want)
		}
	}
}

// TestLocalManyCollectives runs a thousand mixed collectives on 4 ranks,
// in place where they may be: under -race it checks that no rank writes a
// buffer another reads.
func TestLocalManyCollectives(t *testing.T) {
	const size, n = 4, 64
	errs := each(size, func(c *Local) error {
		r := c.Rank()
		full := make([]byte, 4*n*size)
		for step := range 1000 {
			own := full[4*n*r : 4*n*(r+1)]
			for i := range n {
				put(own, F32, i, float64(step+r))
			}
			var err error
			switch step % 3 {
			case 0:
				err = c.AllGather(own, full, F32)
			case 1:
				err = c.ReduceScatter(full, own, F32, Sum)
			case 2:
				err = c.AllReduce(own, own, F32, Avg)
			}
			if err != nil {
				return fmt.Errorf("step %d: %v", step, err)
			}
		}
		return nil
	})
	for r, err := range errs {
		if err != nil {
			t.Errorf("rank %d: %v", r, err)
		}
	}
}

// TestBF16Rounding: the bf16 conversion rounds to nearest even and keeps
// NaN a NaN.
func TestBF16Rounding(t *testing.T) {
	for _, tc := range []struct {
		x    float32
		want uint16
	}{
		{1, 0x3f80}, {math.Float32frombits(0x3f808000), 0x3f80}, {math.Float32frombits(0x3f818000), 0x3f82},
		{math.Float32frombits(0x3f808001), 0x3f81}, {float32(math.Inf(-1)), 0xff80},
	} {
		if got := f32ToBF16(tc.x); got != tc.want {
			t.Errorf("%v (%#x): %#x, want %#x", tc.x, math.Float32bits(tc.x), got, tc.want)
		}
	}
	if got := f32ToBF16(float32(math.NaN())); got&0x7f80 != 0x7f80 || got&0x7f == 0 {
		t.Errorf("NaN: %#x", got)
	}
}
