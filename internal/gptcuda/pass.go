package gptcuda

import (
	"fmt"
	"math"
	"unsafe"

	"github.com/deepstates/dos/gpt"
)

// Tensor indices in gpt.Config.Tensors order: the two embeddings, each
// block's twelve tensors from gpt.LayerBase(l), and ln_f's two at the end.
const (
	tWte = gpt.Wte
	tWpe = gpt.Wpe
)

// layer returns block l's tensor of index off (gpt.Ln1W ... gpt.FcProjB).
func layer(ts []uint64, l, off int) uint64 { return ts[gpt.LayerBase(l)+off] }

// lnf returns ln_f's weight and bias.
func lnf(ts []uint64) (w, b uint64) { return ts[len(ts)-2], ts[len(ts)-1] }

// lnBlock and lnFinal are the tensor indices of a LayerNorm's weight (its
// bias follows it): block l's ln_1 or ln_2 (gpt.Ln1W, gpt.Ln2W), and ln_f.
func lnBlock(l, off int) int  { return gpt.LayerBase(l) + off }
func (m *Model) lnFinal() int { return len(m.masters) - 2 }

// param returns tensor i's address and whether it is fp32: its master
// weights when SetMasters gave them, else w[i] (bf16).
func (m *Model) param(w []uint64, i int) (uint64, bool) {
	if m.masters[i] != 0 {
		return m.masters[i], true
	}
	return w[i], false
}

// ln returns the LayerNorm whose weight is tensor i: weight, bias, and
// whether they are fp32 (SetMasters gives both or neither).
func (m *Model) ln(w []uint64, i int) (pw, pb uint64, f32 bool) {
	pw, f32 = m.param(w, i)
	pb, _ = m.param(w, i+1)
	return pw, pb, f32
}

// Forward runs the model on a batch: tokens and targets are [B*T] token
// ids, row-major over (b, t), each in [0, VocabSize); targets may be nil
// when gradScale is 0 (then Loss is not available). weights are the bf16
// tensors' device addresses in gpt.Config.Tensors order. The loss is the
// mean cross-entropy over the B*T positions. With gradScale > 0 (1, or a
// loss scale) the classifier also computes the gradient of gradScale ×
// loss, which Backward carries through the model.
//
// Forward enqueues its work on the model's stream and returns: the host
// slices are copied before it returns (through pinned memory), the device
// work is not awaited. It allocates nothing.
//
// Errors: wrong lengths, a token or target out of range (naming the
// position), a closed model, a failed launch.
func (m *Model) Forward(weights []uint64, tokens, targets []int32, gradScale float32) error {
	train := gradScale != 0
	if !(gradScale >= 0) || math.IsInf(float64(gradScale), 0) {
		return fmt.Errorf("gptcuda: Forward: gradient scale %v, want a finite value >= 0", gradScale)
	}
	if err := m.tensors(weights, "weight"); err != nil {
		return err
	}
	if len(tokens) != m.bt {
		return fmt.Errorf("gptcuda: Forward: %d tokens, want B*T = %d", len(tokens), m.bt)
	}
	if train && targets == nil {
		return fmt.Errorf("gptcuda: Forward: training needs targets")
	}
	if targets != nil && len(targets) != m.bt {
		return fmt.Errorf("gptcuda: Forward: %d targets, want B*T = %d", len(targets), m.bt)
	}
	// The previous batch's upload must be done before the pinned buffer
	// is rewritten (a no-op when Loss or Backward already waited).
	if err := m.s.Sync(); err != nil {
		return fmt.Errorf("gptcuda: Forward: %w", err)
	}
	if err := m.stageInputs(tokens, targets, train); err != nil {
		return err
	}
	m.trained, m.hasLogits = false, false
	if err := m.forward(weights, targets != nil, gradScale); err != nil {
		return fmt.Errorf("gptcuda: Forward: %w", err)
	}
	m.trained, m.hasLogits = train, !train
	m.hasLoss = targets != nil
	return nil
}

// stageInputs writes tokens, targets and (for training) wte's segments
// into the pinned buffer and uploads them.
func (m *Model) stageInputs(tokens, targets []int32, train bool) error {
	tok := m.int32s(m.tokOff, m.bt)
	for i, x := range tokens {
		if x < 0 || int(x) >= m.v {
			return fmt.Errorf("gptcuda: Forward: token %d at position %d is outside the vocabulary [0, %d)", x, i, m.v)
		}
		tok[i] = x
	}
	n := m.tgtOff
	if targets != nil {
		tgt := m.int32s(m.tgtOff, m.bt)
		for i, x := range targets {
			if x < 0 || int(x) >= m.v {
				return fmt.Errorf("gptcuda: Forward: target %d at position %d is outside the vocabulary [0, %d)", x, i, m.v)
			}
			tgt[i] = x
		}
		n = m.posOff
	}
	if train {
		m.nseg = m.segments(tok)
		n = m.segTokOff + 4*int64(m.nseg)
	}
	return m.s.CopyHtoD(m.in, 0, m.host, 0, n)
}

// segments sorts the positions by token (stably, a counting sort) for wte's
// deterministic backward: segment s holds positions pos[seg[s]:seg[s+1]]
// of token segTok[s]. It returns the number of segments.
func (m *Model) segments(tok []int32) int {
	if m.count == nil {
		m.count = make([]int32, m.v+1)
	}
	cnt := m.count
	clear(cnt)
	for _, x := range tok {
		cnt[x+1]++
	}
	seg := m.int32s(m.segOff, m.bt+1)
	segTok := m.int32s(m.segTokOff, m.bt)
	ns := 0
	var start int32
	for v := 0; v < m.v; v++ {
		c := cnt[v+1]
		cnt[v+1] = start // the next free slot of token v, then its start
		if c > 0 {
			seg[ns], segTok[ns] = start, int32(v)
			ns++
		}
		start += c
	}
	seg[ns] = start
	pos := m.int32s(m.posOff, m.bt)
	for p, x := range tok {
		pos[cnt[x+1]] = int32(p)
		cnt[x+1]++
	}
	return ns
}

// blockActs are the device addresses of block l's activations: its input
// residual (always block l's own) and the arrays forward keeps for backward,
// in the block's slot (l, or 0 with recomputation: one block's worth).
type blockActs struct {
	resid, resid2  uint64
	ln1, ln2       uint64
	st1, st2       uint64 // mean, then rstd at +4*BT
	qkv, att, atty uint64
	fch, fchg, lse uint64
	next, nextLN1  uint64 // resid of block l+1 and its ln_1 slot
	nextSt1        uint64
}

// acts returns block l's addresses.
func (m *Model) acts(l int) blockActs {
	a := &m.act
	bc := uint64(m.bt) * uint64(m.c)
	bt := uint64(m.bt)
	rows := uint64(m.b) * uint64(m.nh) * uint64(m.t)
	slot := func(l int) uint64 {
		if m.recompute {
			return 0
		}
		return uint64(l)
	}
	s, n := slot(l), slot(l+1)
	return blockActs{
		resid: a.resid + 4*uint64(l)*bc, resid2: a.resid2 + 4*s*bc,
		ln1: a.ln1 + 2*s*bc, ln2: a.ln2 + 2*s*bc,
		st1: a.ln1Stat + 4*s*2*bt, st2: a.ln2Stat + 4*s*2*bt,
		qkv: a.qkv + 2*s*3*bc, att: a.att + 2*s*rows*uint64(m.t), atty: a.atty + 2*s*bc,
		fch: a.fch + 2*s*4*bc, fchg: a.fchg + 2*s*4*bc, lse: a.lse + 4*s*rows,
		next: a.resid + 4*uint64(l+1)*bc, nextLN1: a.ln1 + 2*n*bc, nextSt1: a.ln1Stat + 4*n*2*bt,
	}
}

// forward enqueues the forward pass. With loss, the classifier computes
// each position's loss; with gradScale > 0, it also leaves the gradient
// of gradScale × the mean loss in place of the logits.
func (m *Model) forward(w []uint64, loss bool, gradScale float32) error {
	a, g, k, s := &m.act, &m.gemm, m.k, m.s
	BT, C, T := m.bt, m.c, m.t
	wte, f32 := m.param(w, tWte)
	wpe, _ := m.param(w, tWpe)
	if err := k.EncoderForward(s, a.resid, a.tokens, wte, wpe, f32, BT, T, C); err != nil {
		return err
	}
	b0 := m.acts(0)
	lw, lb, f32 := m.ln(w, lnBlock(0, gpt.Ln1W))
	if err := k.LayerNormForward(s, b0.ln1, b0.st1, b0.st1+4*uint64(BT), 0, a.resid, 0, lw, lb, f32, BT, C); err != nil {
		return err
	}
	for l := range m.l {
		if err := m.before(l, false); err != nil {
			return err
		}
		if err := m.block(w, l, true); err != nil {
			return err
		}
	}
	if err := m.blas.Matmul(&g.logits, a.logits, a.lnf, w[tWte], 0, 0); err != nil {
		return fmt.Errorf("logits: %w", err)
	}
	if !loss {
		return nil
	}
	dloss := float32(float64(gradScale) / float64(BT))
	return k.Classifier(s, a.logits, a.lossesDev, a.targets, dloss, BT, m.v)
}

// block enqueues block l's forward from its ln_1 output (already in its
// slot) to resid2, ln_2, the MLP, and, with next, the residual add into
// block l+1's input fused with its ln_1 (or ln_f after the last block).
// Recomputation in backward runs it again without next: every kernel is
// deterministic, so it rewrites the same bits.
func (m *Model) block(w []uint64, l int, next bool) error {
	a, g, k, s := &m.act, &m.gemm, m.k, m.s
	BT, C := m.bt, m.c
	b := m.acts(l)
	if err := m.blas.Matmul(&g.qkv, b.qkv, b.ln1, layer(w, l, gpt.AttnW), layer(w, l, gpt.AttnB), 0); err != nil {
		return at(l, 0, err)
	}
	if err := m.attention(b.qkv, b.att, b.atty, b.lse); err != nil {
		return at(l, 1, err)
	}
	if err := m.blas.Matmul(&g.proj, a.yproj, b.atty, layer(w, l, gpt.AttnProjW), layer(w, l, gpt.AttnProjB), 0); err != nil {
		return at(l, 2, err)
	}
	lw, lb, f32 := m.ln(w, lnBlock(l, gpt.Ln2W))
	if err := k.LayerNormForward(s, b.ln2, b.st2, b.st2+4*uint64(BT), b.resid2, b.resid, a.yproj, lw, lb, f32, BT, C); err != nil {
		return at(l, 3, err)
	}
	if err := m.mlpUp(l, w, b.ln2, b.fch, b.fchg); err != nil {
		return at(l, 4, err)
	}
	if !next {
		return nil
	}
	if err := m.blas.Matmul(&g.fcproj, a.yproj, b.fchg, layer(w, l, gpt.FcProjW), layer(w, l, gpt.FcProjB), 0); err != nil {
		return at(l, 5, err)
	}
	// The residual add and the next LayerNorm: ln_1 of block l+1, or ln_f.
	var err error
	if l+1 < m.l {
		lw, lb, f32 := m.ln(w, lnBlock(l+1, gpt.Ln1W))
		err = k.LayerNormForward(s, b.nextLN1, b.nextSt1, b.nextSt1+4*uint64(BT), b.next, b.resid2, a.yproj, lw, lb, f32, BT, C)
	} else {
		lw, lb, f32 := m.ln(w, m.lnFinal())
		err = k.LayerNormForward(s, a.lnf, a.lnfStat, a.lnfStat+4*uint64(BT), b.next, b.resid2, a.yproj, lw, lb, f32, BT, C)
	}
	if err != nil {
		return at(l, 6, err)
	}
	return nil
}

// recomputeBlock enqueues block l's forward again from its input residual,
// into the one block's worth of activations recomputation keeps.
func (m *Model) recomputeBlock(w []uint64, l int) error {
	b := m.acts(l)
	lw, lb, f32 := m.ln(w, lnBlock(l, gpt.Ln1W))
	if err := m.k.LayerNormForward(m.s, b.ln1, b.st1, b.st1+4*uint64(m.bt), 0, b.resid, 0, lw, lb, f32, m.bt, m.c); err != nil {
		return at(l, 0, err)
	}
	return m.block(w, l, false)
}

// Loss waits for the last Forward and returns its mean cross-entropy over
// the B*T positions, in nats, summed on the host in float64 in position
// order.
//
// Errors: no Forward with targets since the last Backward, a device fault.
func (m *Model) Loss() (float64, error) {
	if !m.ok {
		return 0, ErrClosed
	}
	if !m.hasLoss {
		return 0, fmt.Errorf("gptcuda: Loss: no Forward with targets")
	}
	if err := m.s.CopyDtoH(m.host, m.lossOff, m.lossBuf, 0, 4*int64(m.bt)); err != nil {
		return 0, fmt.Errorf("gptcuda: Loss: %w", err)
	}
	if err := m.s.Sync(); err != nil {
		return 0, fmt.Errorf("gptcuda: Loss: %w", err)
	}
	losses := unsafe.Slice((*float32)(unsafe.Pointer(&m.host.Bytes()[m.lossOff])), m.bt)
	var sum float64
	for _, x := range losses {
		sum += float64(x)
	}
	return sum / float64(m.bt), nil
}

// BeforeBlock sets f, which Forward calls before it enqueues block l's
// forward (l from 0 up, backward false) and Backward before it enqueues
// block l's backward and, with Options.Recompute, its recomputed forward
// (l from NLayer-1 down, backward true). What f enqueues on the model's
// stream runs before the block's kernels and after the previous block's,
// and the block's kernels read the addresses in the weight and gradient
// lists when they are enqueued, after f: so f may fill the block's
// tensors just in time, which is how ZeRO-3 all-gathers a block's
// parameters before its forward and backward into memory the other
// blocks reuse (DeepSpeed's stage 3 prefetches the same way; llm.c has no
// such point). Block l's forward also reads block l+1's ln_1 weight and
// bias (the residual add is fused with the next LayerNorm), and block l's
// backward writes the gradients of its own tensors only. f runs on the
// calling goroutine between launches, must not use the model, and its
// error stops the pass. nil removes it.
func (m *Model) BeforeBlock(f func(l int, backward bool) error) { m.beforeBlock = f }

// before calls BeforeBlock's function, its error naming the block.
func (m *Model) before(l int, backward bool) error {
	if m.beforeBlock == nil {
		return nil
	}
	if err := m.beforeBlock(l, backward); err != nil {
		return fmt.Errorf("before block %d: %w", l, err)
	}
	return nil
}

// OnBlockBackward sets f, which Backward calls after it has enqueued the
// backward of block l, for l from NLayer-1 down to 0: once the work on the
// model's stream so far is done, the gradients of block l's tensors, of
// every later block's and of ln_f are final (wte's and wpe's only when
// Backward's work is). f runs on Backward's goroutine between launches,
// must not use the model, and its error stops Backward. nil removes it.
// llm.c's gpt2_backward has no such point; it is where a ZeRO-3 offload
// starts moving the last blocks' gradients during backward, as Deep
// Optimizer States' artifact does (offload.Optimizer.GradsFinal).
func (m *Model) OnBlockBackward(f func(l int) error) { m.onBlock = f }

// Backward computes the gradient of the last Forward's mean loss (which
// must have had train set) with respect to every weight and writes it,
// overwriting every element, into grads (bf16 device arrays in
// gpt.Config.Tensors order, each the length of its tensor). weights must
// be what that Forward read, unchanged. It enqueues on the model's stream
// and returns; the gradients are complete once the stream's work is (sync
// the stream, or wait on an event recorded after Backward, before an
// optimizer reads them). It allocates nothing.
//
// Errors: no training Forward before it, wrong tensor lists, a failed
// launch.
func (m *Model) Backward(weights, grads []uint64) error {
	if err := m.tensors(weights, "weight"); err != nil {
		return err
	}
	if err := m.tensors(grads, "gradient"); err != nil {
		return err
	}
	if !m.trained {
		return fmt.Errorf("gptcuda: Backward without a training Forward before it")
	}
	m.trained = false
	if err := m.backward(weights, grads); err != nil {
		return fmt.Errorf("gptcuda: Backward: %w", err)
	}
	return nil
}

func (m *Model) backward(w, dw []uint64) error {
	a, g, k, s := &m.act, &m.gemm, m.k, m.s
	BT, C, L, T, V := m.bt, m.c, m.l, m.t, m.v
	statOff := 4 * uint64(BT)
	// The classifier: logits now hold dlogits.
	if err := m.blas.Matmul(&g.dwte, a.dwte, a.logits, a.lnf, 0, 0); err != nil {
		return fmt.Errorf("dwte: %w", err)
	}
	if err := m.blas.Matmul(&g.dlnf, a.dln, a.logits, w[tWte], 0, 0); err != nil {
		return fmt.Errorf("dlnf: %w", err)
	}
	fw, fwf32 := m.param(w, m.lnFinal())
	dfw, dfb := lnf(dw)
	residL := a.resid + 4*uint64(L)*uint64(BT)*uint64(C)
	if err := k.LayerNormBackward(s, a.dres, a.dres16, a.dln, residL, fw, fwf32, a.lnfStat, a.lnfStat+statOff, false, BT, C); err != nil {
		return err
	}
	if err := k.ColSum(s, dfb, dfw, a.part, a.dln, residL, a.lnfStat, a.lnfStat+statOff, BT, C); err != nil {
		return err
	}
	for l := L - 1; l >= 0; l-- {
		if err := m.before(l, true); err != nil {
			return err
		}
		if m.recompute && l < L-1 { // the last block's are still there from forward
			if err := m.recomputeBlock(w, l); err != nil {
				return fmt.Errorf("recomputing: %w", err)
			}
		}
		b := m.acts(l)
		resid, resid2, ln1, ln2, st1, st2 := b.resid, b.resid2, b.ln1, b.ln2, b.st1, b.st2
		qkv, atty, fch, fchg := b.qkv, b.atty, b.fch, b.fchg
		// The MLP: dres16 is the gradient of c_proj's output.
		if err := m.blas.Matmul(&g.dW[3], layer(dw, l, gpt.FcProjW), fchg, a.dres16, 0, 0); err != nil {
			return at(l, 0, err)
		}
		if err := k.ColSum(s, layer(dw, l, gpt.FcProjB), 0, a.part, a.dres16, 0, 0, 0, BT, C); err != nil {
			return at(l, 1, err)
		}
		if err := m.mlpDown(l, w, fch); err != nil {
			return at(l, 2, err)
		}
		if err := m.blas.Matmul(&g.dW[2], layer(dw, l, gpt.FcW), ln2, a.dbig2, 0, 0); err != nil {
			return at(l, 3, err)
		}
		if err := k.ColSum(s, layer(dw, l, gpt.FcB), 0, a.part, a.dbig2, 0, 0, 0, BT, 4*C); err != nil {
			return at(l, 4, err)
		}
		if err := m.blas.Matmul(&g.dX[2], a.dln, a.dbig2, layer(w, l, gpt.FcW), 0, 0); err != nil {
			return at(l, 5, err)
		}
		ln2w, f32 := m.param(w, lnBlock(l, gpt.Ln2W))
		if err := k.LayerNormBackward(s, a.dres, a.dres16, a.dln, resid2, ln2w, f32, st2, st2+statOff, true, BT, C); err != nil {
			return at(l, 6, err)
		}
		if err := k.ColSum(s, layer(dw, l, gpt.Ln2B), layer(dw, l, gpt.Ln2W), a.part, a.dln, resid2, st2, st2+statOff, BT, C); err != nil {
			return at(l, 7, err)
		}
		// Attention's output projection.
		if err := m.blas.Matmul(&g.dW[1], layer(dw, l, gpt.AttnProjW), atty, a.dres16, 0, 0); err != nil {
			return at(l, 8, err)
		}
		if err := k.ColSum(s, layer(dw, l, gpt.AttnProjB), 0, a.part, a.dres16, 0, 0, 0, BT, C); err != nil {
			return at(l, 9, err)
		}
		if err := m.blas.Matmul(&g.dX[1], a.dln, a.dres16, layer(w, l, gpt.AttnProjW), 0, 0); err != nil {
			return at(l, 10, err)
		}
		// Attention: dbig gets dqkv from datty (dln).
		if err := m.attentionBackward(qkv, b.att, atty, b.lse); err != nil {
			return at(l, 11, err)
		}
		// c_attn: dbig holds dqkv [BT, 3C].
		if err := m.blas.Matmul(&g.dW[0], layer(dw, l, gpt.AttnW), ln1, a.dbig, 0, 0); err != nil {
			return at(l, 12, err)
		}
		if err := k.ColSum(s, layer(dw, l, gpt.AttnB), 0, a.part, a.dbig, 0, 0, 0, BT, 3*C); err != nil {
			return at(l, 13, err)
		}
		if err := m.blas.Matmul(&g.dX[0], a.dln, a.dbig, layer(w, l, gpt.AttnW), 0, 0); err != nil {
			return at(l, 14, err)
		}
		ln1w, f32 := m.param(w, lnBlock(l, gpt.Ln1W))
		if err := k.LayerNormBackward(s, a.dres, a.dres16, a.dln, resid, ln1w, f32, st1, st1+statOff, true, BT, C); err != nil {
			return at(l, 15, err)
		}
		if err := k.ColSum(s, layer(dw, l, gpt.Ln1B), layer(dw, l, gpt.Ln1W), a.part, a.dln, resid, st1, st1+statOff, BT, C); err != nil {
			return at(l, 16, err)
		}
		if m.onBlock != nil {
			if err := m.onBlock(l); err != nil {
				return fmt.Errorf("after block %d: %w", l, err)
			}
		}
	}
	// The embeddings: dres is the gradient of wte[tok] + wpe[t].
	if err := k.WpeBackward(s, dw[tWpe], a.dres, m.b, T, m.cfg.NCtx, C); err != nil {
		return err
	}
	if m.nseg > 0 {
		if err := k.WteBackward(s, a.dwte, a.dres, a.pos, a.seg, a.segTok, m.nseg, C); err != nil {
			return err
		}
	}
	return k.CastBF16(s, dw[tWte], a.dwte, int64(V)*int64(C))
}

// LogitsAt waits for the last Forward and copies the logits of position
// pos (row-major over (b, t), in [0, B*T)) into dst, VocabSize float32s
// (exact: they are bf16): what sampling reads. The errors are Logits's,
// and a pos out of range.
func (m *Model) LogitsAt(pos int, dst []float32) error {
	if !m.ok {
		return ErrClosed
	}
	if pos < 0 || pos >= m.bt || len(dst) != m.v {
		return fmt.Errorf("gptcuda: LogitsAt(%d): %d elements; want a position in [0, %d) and VocabSize = %d elements", pos, len(dst), m.bt, m.v)
	}
	return m.copyLogits(dst, int64(pos)*int64(m.v))
}

// Logits waits for the last Forward and copies its logits, [B*T,
// VocabSize] row-major, into dst as float32 (exact: they are bf16). After a
// training Forward they hold the loss's gradient instead, and Logits
// returns an error.
func (m *Model) Logits(dst []float32) error {
	if !m.ok {
		return ErrClosed
	}
	n := m.bt * m.v
	if len(dst) != n {
		return fmt.Errorf("gptcuda: Logits: %d elements, want B*T*V = %d", len(dst), n)
	}
	return m.copyLogits(dst, 0)
}

// copyLogits copies len(dst) logits from element off through pinned memory.
func (m *Model) copyLogits(dst []float32, off int64) error {
	if !m.hasLogits {
		return fmt.Errorf("gptcuda: Logits: no logits: the last Forward trained (its logits were replaced by their gradient), or there was none")
	}
	n := int64(len(dst))
	if m.logitsHost == nil || m.logitsHost.Len() < 2*n {
		if m.logitsHost != nil {
			if err := m.logitsHost.Free(); err != nil {
				return fmt.Errorf("gptcuda: Logits: %w", err)
			}
			m.logitsHost = nil
		}
		h, err := m.s.Device().HostAlloc(2 * n)
		if err != nil {
			return fmt.Errorf("gptcuda: Logits: %w", err)
		}
		m.logitsHost = h
	}
	if err := m.s.CopyDtoH(m.logitsHost, 0, m.logitBuf, 2*off, 2*n); err != nil {
		return fmt.Errorf("gptcuda: Logits: %w", err)
	}
	if err := m.s.Sync(); err != nil {
		return fmt.Errorf("gptcuda: Logits: %w", err)
	}
	src := unsafe.Slice((*uint16)(unsafe.Pointer(&m.logitsHost.Bytes()[0])), n)
	for i, x := range src {
		dst[i] = math.Float32frombits(uint32(x) << 16)
	}
	return nil
}

// at wraps the error of step i of block l's pass.
func at(l, i int, err error) error { return fmt.Errorf("block %d, step %d: %w", l, i, err) }

// attention enqueues a block's causal self-attention from qkv [BT, 3C] to
// atty [BT, C]; attL is the block's attention matrix (cuBLAS path), lse
// its log-sum-exps (flash).
func (m *Model) attention(qkv, attL, atty, lse uint64) error {
	a, g, k, s, T := &m.act, &m.gemm, m.k, m.s, m.t
	if m.attn == AttentionFlash {
		return k.FlashForward(s, atty, lse, qkv, m.b, T, m.nh, m.scale())
	}
	if err := k.PermuteQKV(s, a.q, a.k, a.v, qkv, m.b, T, m.nh, m.hs); err != nil {
		return err
	}
	if err := m.blas.Matmul(&g.scores, a.pre, a.q, a.k, 0, 0); err != nil {
		return err
	}
	if err := k.SoftmaxForward(s, attL, a.pre, m.b*m.nh*T, T); err != nil {
		return err
	}
	if err := m.blas.Matmul(&g.attV, a.y, attL, a.v, 0, 0); err != nil {
		return err
	}
	return k.Unpermute(s, atty, a.y, m.b, T, m.nh, m.hs)
}

// attentionBackward enqueues a block's attention backward: from datty (in
// act.dln) to dqkv (in act.dbig, [BT, 3C]).
func (m *Model) attentionBackward(qkv, attL, atty, lse uint64) error {
	a, g, k, s, T := &m.act, &m.gemm, m.k, m.s, m.t
	if m.attn == AttentionFlash {
		return k.FlashBackward(s, a.dbig, qkv, atty, a.dln, lse, a.dsum, m.b, T, m.nh, m.scale())
	}
	if err := k.UnpermuteBackward(s, a.y, a.dln, m.b, T, m.nh, m.hs); err != nil {
		return err
	}
	if err := k.PermuteQKV(s, a.q, a.k, a.v, qkv, m.b, T, m.nh, m.hs); err != nil {
		return err
	}
	if err := m.blas.Matmul(&g.datt, a.pre, a.y, a.v, 0, 0); err != nil {
		return err
	}
	if err := m.blas.Matmul(&g.dv, a.dv, attL, a.y, 0, 0); err != nil {
		return err
	}
	if err := k.SoftmaxBackward(s, a.dpre, a.pre, attL, m.scale(), m.b*m.nh*T, T); err != nil {
		return err
	}
	if err := m.blas.Matmul(&g.dq, a.dq, a.dpre, a.k, 0, 0); err != nil {
		return err
	}
	if err := m.blas.Matmul(&g.dk, a.dk, a.dpre, a.q, 0, 0); err != nil {
		return err
	}
	return k.PermuteQKVBackward(s, a.dbig, a.dq, a.dk, a.dv, m.b, T, m.nh, m.hs)
}

// scale is attention's 1/sqrt(head size).
func (m *Model) scale() float32 { return float32(1 / math.Sqrt(float64(m.hs))) }

// mlpUp enqueues c_fc and the GELU: fchg = gelu(ln2 · W + b), the
// pre-activation kept in fch; in one product with the GELU epilogue, or a
// product and gpt_gelu_forward.
func (m *Model) mlpUp(l int, w []uint64, ln2, fch, fchg uint64) error {
	W, b := layer(w, l, gpt.FcW), layer(w, l, gpt.FcB)
	if m.fusedGELU {
		return m.blas.Matmul(&m.gemm.fcGELU, fchg, ln2, W, b, fch)
	}
	if err := m.blas.Matmul(&m.gemm.fc, fch, ln2, W, b, 0); err != nil {
		return err
	}
	return m.k.GELUForward(m.s, fchg, fch, 4*int64(m.bt)*int64(m.c))
}

// mlpDown enqueues the gradient through c_proj's input and the GELU: dbig2
// = (dres16 · Wᵀ) ∘ gelu'(fch); in one product with the DGELU epilogue, or
// a product and gpt_gelu_backward.
func (m *Model) mlpDown(l int, w []uint64, fch uint64) error {
	a, W := &m.act, layer(w, l, gpt.FcProjW)
	if m.fusedGELU {
		return m.blas.Matmul(&m.gemm.dXGELU, a.dbig2, a.dres16, W, 0, fch)
	}
	if err := m.blas.Matmul(&m.gemm.dX[3], a.dbig, a.dres16, W, 0, 0); err != nil {
		return err
	}
	return m.k.GELUBackward(m.s, a.dbig2, fch, a.dbig, 4*int64(m.bt)*int64(m.c))
}
