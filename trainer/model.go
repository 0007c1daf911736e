package trainer

import (
	"fmt"
	"math"
	"runtime"

	"github.com/deepstates/dos/gpt"
)

// Model is a GPT-2 language model (Hugging Face GPT2LMHeadModel in eval mode)
// with its forward and backward pass written out by hand, as karpathy/llm.c's
// train_gpt2.c does, for a batch of B sequences of T tokens (T <= NCtx) in
// float type F. It owns the activations and scratch buffers, allocated once by
// NewModel; the parameters and gradients are the caller's, passed to each
// call as slices in Config.Tensors order.
//
// The model, per position (b, t):
//
//	x = wte[token] + wpe[t]
//	for each block: x = x + attn(ln_1(x)); x = x + mlp(ln_2(x))
//	logits = ln_f(x) @ wteᵀ
//
// LayerNorm has eps 1e-5 and the biased variance. attn is causal
// multi-head self-attention: c_attn gives q, k and v (columns [0,C), [C,2C),
// [2C,3C)), head h takes columns [h*hs, (h+1)*hs) of each for hs = C/NHead,
// scores are q·k/sqrt(hs), and c_proj mixes the heads. mlp is c_fc, GELU with
// the tanh approximation (HF "gelu_new"), c_proj. There is no dropout.
//
// Matrix products run through gonum's BLAS (Sgemm, Dgemm): the linear layers
// and the tied head cut into tiles computed on up to GOMAXPROCS goroutines,
// attention's products per (sequence, head). The other loops (LayerNorm,
// softmax, GELU, residuals, cross-entropy, bias and LayerNorm gradients) are
// plain Go, also spread over goroutines. Every output element is computed by
// one goroutine in a fixed order, so results are bitwise identical whatever
// GOMAXPROCS is.
//
// A Model is not safe for concurrent use. Its worker goroutines stop once it
// is garbage collected.
//
// References: HF transformers models/gpt2/modeling_gpt2.py (GPT2Attention,
// GPT2MLP, GPT2Block, GPT2LMHeadModel) and activations.py (NewGELUActivation);
// karpathy/llm.c train_gpt2.c (layernorm, matmul, attention, gelu, residual,
// softmax and cross-entropy forward and backward).
type Model[F float32 | float64] struct {
	cfg    Config
	b, t   int
	bt     int   // b*t
	hs     int   // head size C/NHead
	sizes  []int // element count of each parameter tensor
	forwd  bool  // a Forward has run
	hasTgt bool  // ... with targets

	tokens  []int32 // [BT] copy of the last Forward's tokens
	targets []int32 // [BT] copy of its targets

	// Activations of the last Forward, kept for Backward.
	encoded []F       // [BT, C]
	ln1     []F       // [L, BT, C]
	ln1Mean []F       // [L, BT]
	ln1Rstd []F       // [L, BT]
	qkv     []F       // [L, BT, 3C]
	att     []F       // [L, B, NHead, T, T] softmax rows (t2 <= t used)
	atty    []F       // [L, BT, C] attention output before c_proj
	res2    []F       // [L, BT, C] residual after attention
	ln2     []F       // [L, BT, C]
	ln2Mean []F       // [L, BT]
	ln2Rstd []F       // [L, BT]
	fch     []F       // [L, BT, 4C] c_fc output
	fchGelu []F       // [L, BT, 4C] GELU of it
	res3    []F       // [L, BT, C] residual after the MLP
	lnf     []F       // [BT, C]
	lnfMean []F       // [BT]
	lnfRstd []F       // [BT]
	logits  []F       // [BT, V]
	lse     []float64 // [BT] log-sum-exp of each logits row (nats)
	losses  []float64 // [BT] cross-entropy of each position (nats)

	// Scratch.
	proj    []F              // [BT, C] c_proj outputs in Forward
	dres    []F              // [BT, C] gradient of the residual stream
	dln     []F              // [BT, C] gradient of a LayerNorm output, or of atty
	dbig    []F              // [BT, 4C] gradient of fch, later of qkv
	dlogits []F              // [BT, V]
	wT      []F              // [max(4C*C, V*C)] a weight transposed, [out, in]
	aT      []F              // [BT * max(4C, V)] a gemm's left operand transposed, [in, BT]
	yT      []F              // [BT * 4C] a gradient transposed, [out, BT]
	scratch []attnScratch[F] // one per goroutine of the pool

	pool *pool
	gj   gemmJob[F]
	tj   transposeJob[F]
	k    kernelArgs[F]

	// Method values, built once so that handing them to the pool allocates
	// nothing.
	fnGemm, fnTranspose, fnLnFwd, fnLnBwdRows, fnLnBwdCols, fnColSum func(i, w int)
	fnAttnFwd, fnAttnBwd, fnGeluFwd, fnGeluBwd, fnCE, fnCEBwd        func(i, w int)
}

// kernelArgs are the arguments of the plain-Go kernel the pool is running.
type kernelArgs[F float32 | float64] struct {
	l                    int // layer (attention)
	out, mean, rstd, inp []F
	w, bias              []F
	dout, dinp, dw, db   []F
	cols                 int // row width (GELU, column sums)
	dloss                F   // d(scale*loss)/d(loss of one position): scale/BT
}

// Work split of the plain-Go kernels: rows of [BT, ·] per task, and columns
// per task for the reductions over rows (which always run over all rows in
// order, so the split does not change any sum).
const (
	rowsPerTask = 16
	colsPerTask = 64
)

// LayerNormEps is the epsilon of every LayerNorm (ln_1, ln_2, ln_f): HF
// GPT2Config.layer_norm_epsilon's default, added to the biased variance.
const LayerNormEps = 1e-5

// NewModel allocates a Model for c with batch size B and sequence length T:
// about L*(16C + NHead*T) + 13C + 2V + max(4C, V) floats of type F per
// position (B*T of them; 12M floats for L 4, C 128, NHead 4, V 256, B 16,
// T 64), plus max(4C, V)*C and, per goroutine, 3T² + 4T*C/NHead. It panics
// if c is invalid, B < 1, T < 1 or T > c.NCtx.
func NewModel[F float32 | float64](c Config, B, T int) *Model[F] {
	if err := c.Validate(); err != nil {
		panic(err)
	}
	if B < 1 || T < 1 || T > c.NCtx {
		panic(fmt.Sprintf("trainer: NewModel B = %d, T = %d: want B >= 1 and 1 <= T <= n_positions = %d", B, T, c.NCtx))
	}
	L, C, V, NH := c.NLayer, c.NEmbd, c.VocabSize, c.NHead
	// Refuse sizes whose element counts would overflow int.
	perPos := float64(L)*(16*float64(C)+4+float64(NH)*float64(T)) + 13*float64(C) + 3*float64(V)
	if float64(B)*float64(T)*perPos > 1<<50 {
		panic(fmt.Sprintf("trainer: NewModel B = %d, T = %d: activations too large for %+v", B, T, c))
	}
	BT := B * T
	m := &Model[F]{cfg: c, b: B, t: T, bt: BT, hs: C / NH, pool: newPool()}
	for _, p := range c.Tensors() {
		m.sizes = append(m.sizes, p.Numel())
	}
	m.tokens = make([]int32, BT)
	m.targets = make([]int32, BT)
	m.encoded = make([]F, BT*C)
	m.ln1 = make([]F, L*BT*C)
	m.ln1Mean = make([]F, L*BT)
	m.ln1Rstd = make([]F, L*BT)
	m.qkv = make([]F, L*BT*3*C)
	m.att = make([]F, L*B*NH*T*T)
	m.atty = make([]F, L*BT*C)
	m.res2 = make([]F, L*BT*C)
	m.ln2 = make([]F, L*BT*C)
	m.ln2Mean = make([]F, L*BT)
	m.ln2Rstd = make([]F, L*BT)
	m.fch = make([]F, L*BT*4*C)
	m.fchGelu = make([]F, L*BT*4*C)
	m.res3 = make([]F, L*BT*C)
	m.lnf = make([]F, BT*C)
	m.lnfMean = make([]F, BT)
	m.lnfRstd = make([]F, BT)
	m.logits = make([]F, BT*V)
	m.lse = make([]float64, BT)
	m.losses = make([]float64, BT)
	m.proj = make([]F, BT*C)
	m.dres = make([]F, BT*C)
	m.dln = make([]F, BT*C)
	m.dbig = make([]F, BT*4*C)
	m.dlogits = make([]F, BT*V)
	m.wT = make([]F, max(4*C*C, V*C))
	m.aT = make([]F, BT*max(4*C, V))
	m.yT = make([]F, BT*4*C)
	for range m.pool.threads(B * NH) {
		m.scratch = append(m.scratch, newAttnScratch[F](T, C/NH))
	}

	m.fnGemm = m.gj.tile
	m.fnTranspose = m.tj.task
	m.fnLnFwd = m.lnFwdTask
	m.fnLnBwdRows = m.lnBwdRowsTask
	m.fnLnBwdCols = m.lnBwdColsTask
	m.fnColSum = m.colSumTask
	m.fnAttnFwd = m.attnFwdTask
	m.fnAttnBwd = m.attnBwdTask
	m.fnGeluFwd = m.geluFwdTask
	m.fnGeluBwd = m.geluBwdTask
	m.fnCE = m.ceTask
	m.fnCEBwd = m.ceBwdTask
	runtime.AddCleanup(m, (*pool).stop, m.pool)
	return m
}

// Config returns the model's configuration.
func (m *Model[F]) Config() Config { return m.cfg }

// Shape returns the batch size B and sequence length T the Model was built for.
func (m *Model[F]) Shape() (B, T int) { return m.b, m.t }

// checkTensors panics unless ts has one slice per parameter tensor, each of
// its tensor's length.
func (m *Model[F]) checkTensors(ts [][]F, what string) {
	if len(ts) != len(m.sizes) {
		panic(fmt.Sprintf("trainer: %d %s tensors, want %d (Config.Tensors order)", len(ts), what, len(m.sizes)))
	}
	for i, n := range m.sizes {
		if len(ts[i]) != n {
			panic(fmt.Sprintf("trainer: %s tensor %d (%s) has %d elements, want %d", what, i, m.cfg.Tensors()[i].Name, len(ts[i]), n))
		}
	}
}

// Forward runs the model on tokens, [B*T] token ids row-major over (b, t),
// with params, one slice per tensor of Config.Tensors in that order (lengths
// the products of the shapes). Position t of every sequence uses wpe row t.
//
// If targets is not nil, it holds the [B*T] next-token ids, and Forward
// returns the mean cross-entropy over the B*T positions in nats (natural
// log), as torch.nn.functional.cross_entropy on the logits; a later Backward
// differentiates it. If targets is nil, Forward returns 0 and only Logits is
// meaningful.
//
// Forward allocates nothing. It panics if a length is wrong or a token or
// target is outside [0, VocabSize).
func (m *Model[F]) Forward(params [][]F, tokens, targets []int32) F {
	m.checkTensors(params, "params")
	c := m.cfg
	BT, C, V, L := m.bt, c.NEmbd, c.VocabSize, c.NLayer
	if len(tokens) != BT {
		panic(fmt.Sprintf("trainer: Forward got %d tokens, want B*T = %d", len(tokens), BT))
	}
	if targets != nil && len(targets) != BT {
		panic(fmt.Sprintf("trainer: Forward got %d targets, want B*T = %d", len(targets), BT))
	}
	for i, tok := range tokens {
		if tok < 0 || int(tok) >= V {
			panic(fmt.Sprintf("trainer: token %d at position %d outside [0, %d)", tok, i, V))
		}
	}
	for i, tok := range targets {
		if tok < 0 || int(tok) >= V {
			panic(fmt.Sprintf("trainer: target %d at position %d outside [0, %d)", tok, i, V))
		}
	}
	copy(m.tokens, tokens)
	m.forwd, m.hasTgt = false, false

	wte, wpe := params[gpt.Wte], params[gpt.Wpe]
	for i, tok := range tokens {
		t := i % m.t
		e, te, pe := m.encoded[i*C:(i+1)*C], wte[int(tok)*C:][:C], wpe[t*C:][:C]
		for j := range e {
			e[j] = te[j] + pe[j]
		}
	}

	inp := m.encoded
	for l := 0; l < L; l++ {
		p := params[gpt.LayerBase(l):]
		act, stat := l*BT*C, l*BT
		ln1, ln1Mean, ln1Rstd := m.ln1[act:act+BT*C], m.ln1Mean[stat:stat+BT], m.ln1Rstd[stat:stat+BT]
		qkv := m.qkv[3*act : 3*act+3*BT*C]
		atty, res2 := m.atty[act:act+BT*C], m.res2[act:act+BT*C]
		ln2, ln2Mean, ln2Rstd := m.ln2[act:act+BT*C], m.ln2Mean[stat:stat+BT], m.ln2Rstd[stat:stat+BT]
		fch, fchGelu := m.fch[4*act:4*act+4*BT*C], m.fchGelu[4*act:4*act+4*BT*C]
		res3 := m.res3[act : act+BT*C]

		m.layerNorm(ln1, ln1Mean, ln1Rstd, inp, p[gpt.Ln1W], p[gpt.Ln1B])
		m.linear(qkv, ln1, p[gpt.AttnW], p[gpt.AttnB], C, 3*C)
		m.k.l = l
		m.runAttn(m.fnAttnFwd)
		m.linear(m.proj, atty, p[gpt.AttnProjW], p[gpt.AttnProjB], C, C)
		add(res2, inp, m.proj)
		m.layerNorm(ln2, ln2Mean, ln2Rstd, res2, p[gpt.Ln2W], p[gpt.Ln2B])
		m.linear(fch, ln2, p[gpt.FcW], p[gpt.FcB], C, 4*C)
		m.k.inp, m.k.out, m.k.cols = fch, fchGelu, 4*C
		m.runRows(m.fnGeluFwd)
		m.linear(m.proj, fchGelu, p[gpt.FcProjW], p[gpt.FcProjB], 4*C, C)
		add(res3, res2, m.proj)
		inp = res3
	}
	lnf := gpt.LayerBase(L)
	m.layerNorm(m.lnf, m.lnfMean, m.lnfRstd, inp, params[lnf+gpt.LnfW], params[lnf+gpt.LnfB])
	m.matmul(false, true, BT, V, C, m.lnf, C, wte, C, 0, m.logits, V)
	m.k = kernelArgs[F]{}
	m.forwd = true
	if targets == nil {
		return 0
	}
	copy(m.targets, targets)
	m.hasTgt = true
	m.runRows(m.fnCE)
	var sum float64
	for _, x := range m.losses {
		sum += x
	}
	return F(sum / float64(BT))
}

// Logits returns the logits of the last Forward, [B*T*VocabSize] row-major
// over (b, t, vocabulary): a view of the Model's buffer, valid until the next
// Forward. The caller must not write to it.
func (m *Model[F]) Logits() []F { return m.logits }

// Backward computes the gradient of scale*loss, loss being the mean
// cross-entropy of the last Forward (which must have had targets), with
// respect to every parameter, and writes it into grads (one slice per tensor,
// Config.Tensors order and lengths): every element is overwritten, not
// accumulated, so grads need no zeroing; wpe rows T..NCtx-1 get 0. params must
// be the slices (and values) given to that Forward. scale is the loss scale
// (1 for none); it multiplies the gradient of the loss at the start, so a
// power of two scales every gradient exactly.
//
// Backward allocates nothing. It panics if no Forward with targets preceded
// it or a length is wrong.
func (m *Model[F]) Backward(params, grads [][]F, scale F) {
	if !m.forwd || !m.hasTgt {
		panic("trainer: Backward without a Forward with targets")
	}
	m.checkTensors(params, "params")
	m.checkTensors(grads, "grads")
	c := m.cfg
	BT, C, V, L := m.bt, c.NEmbd, c.VocabSize, c.NLayer

	// Cross-entropy, then the tied head: logits = lnf @ wteᵀ.
	m.k.dloss = scale / F(BT)
	m.runRows(m.fnCEBwd)
	m.transpose(m.aT, m.dlogits, BT, V)
	m.transpose(m.yT, m.lnf, BT, C)
	m.matmul(false, true, V, C, BT, m.aT, BT, m.yT, BT, 0, grads[gpt.Wte], C) // d wte = d logitsᵀ @ lnf
	m.transpose(m.wT, params[gpt.Wte], V, C)
	m.matmul(false, true, BT, C, V, m.dlogits, V, m.wT, V, 0, m.dln, C) // d lnf = d logits @ wte
	lnf := gpt.LayerBase(L)
	clear(m.dres)
	last := m.encoded
	if L > 0 {
		last = m.res3[(L-1)*BT*C : L*BT*C]
	}
	m.layerNormBackward(m.dres, grads[lnf+gpt.LnfW], grads[lnf+gpt.LnfB], m.dln, last, params[lnf+gpt.LnfW], m.lnfMean, m.lnfRstd)

	for l := L - 1; l >= 0; l-- {
		p, g := params[gpt.LayerBase(l):], grads[gpt.LayerBase(l):]
		act, stat := l*BT*C, l*BT
		inp := m.encoded
		if l > 0 {
			inp = m.res3[act-BT*C : act]
		}
		ln1, ln1Mean, ln1Rstd := m.ln1[act:act+BT*C], m.ln1Mean[stat:stat+BT], m.ln1Rstd[stat:stat+BT]
		atty, res2 := m.atty[act:act+BT*C], m.res2[act:act+BT*C]
		ln2, ln2Mean, ln2Rstd := m.ln2[act:act+BT*C], m.ln2Mean[stat:stat+BT], m.ln2Rstd[stat:stat+BT]
		fch, fchGelu := m.fch[4*act:4*act+4*BT*C], m.fchGelu[4*act:4*act+4*BT*C]
		dfch, dqkv := m.dbig[:4*BT*C], m.dbig[:3*BT*C]

		// MLP: res3 = res2 + c_proj(gelu(c_fc(ln_2(res2)))).
		m.linearBackward(dfch, g[gpt.FcProjW], g[gpt.FcProjB], m.dres, fchGelu, p[gpt.FcProjW], 4*C, C)
		m.k.inp, m.k.dout, m.k.cols = fch, dfch, 4*C
		m.runRows(m.fnGeluBwd)
		m.linearBackward(m.dln, g[gpt.FcW], g[gpt.FcB], dfch, ln2, p[gpt.FcW], C, 4*C)
		m.layerNormBackward(m.dres, g[gpt.Ln2W], g[gpt.Ln2B], m.dln, res2, p[gpt.Ln2W], ln2Mean, ln2Rstd)

		// Attention: res2 = inp + c_proj(attn(c_attn(ln_1(inp)))).
		m.linearBackward(m.dln, g[gpt.AttnProjW], g[gpt.AttnProjB], m.dres, atty, p[gpt.AttnProjW], C, C)
		m.k.l, m.k.dout, m.k.dinp = l, m.dln, dqkv
		m.runAttn(m.fnAttnBwd)
		m.linearBackward(m.dln, g[gpt.AttnW], g[gpt.AttnB], dqkv, ln1, p[gpt.AttnW], C, 3*C)
		m.layerNormBackward(m.dres, g[gpt.Ln1W], g[gpt.Ln1B], m.dln, inp, p[gpt.Ln1W], ln1Mean, ln1Rstd)
	}

	// Embeddings: encoded = wte[token] + wpe[t]. Positions sharing a token
	// add into the same wte row, in position order.
	dwte, dwpe := grads[gpt.Wte], grads[gpt.Wpe]
	clear(dwpe)
	for i, tok := range m.tokens {
		t := i % m.t
		d, te, pe := m.dres[i*C:(i+1)*C], dwte[int(tok)*C:][:C], dwpe[t*C:][:C]
		for j, x := range d {
			te[j] += x
			pe[j] += x
		}
	}
	m.k = kernelArgs[F]{}
}

// runRows runs fn over the B*T rows, rowsPerTask rows per task.
func (m *Model[F]) runRows(fn func(i, w int)) {
	m.pool.run((m.bt+rowsPerTask-1)/rowsPerTask, fn)
}

// rowRange returns the rows of task i of runRows.
func (m *Model[F]) rowRange(i int) (r0, r1 int) {
	return i * rowsPerTask, min((i+1)*rowsPerTask, m.bt)
}

// matmul computes C = op(A) op(B) + beta C (C m×n, see gemm) in tiles on the
// pool.
//
// Every product of the model is given to it as A @ Bᵀ with both operands
// row-major (tA false, tB true), transposing an operand first where needed:
// gonum's serial kernel then computes each element as one dot product over
// k, which runs about twice as fast as its axpy-based forms (A @ B, Aᵀ @ B).
func (m *Model[F]) matmul(tA, tB bool, M, N, K int, a []F, lda int, b []F, ldb int, beta F, c []F, ldc int) {
	m.gj = gemmJob[F]{tA: tA, tB: tB, m: M, n: N, k: K, a: a, lda: lda, b: b, ldb: ldb, beta: beta, c: c, ldc: ldc,
		tilesN: (N + tileN - 1) / tileN}
	m.pool.run((M+tileM-1)/tileM*m.gj.tilesN, m.fnGemm)
	m.gj = gemmJob[F]{}
}

// linear computes out = inp @ w + bias over the B*T rows (HF Conv1D:
// torch.addmm(bias, x, weight)): inp [BT, in], w [in, outC], out [BT, outC].
func (m *Model[F]) linear(out, inp, w, bias []F, in, outC int) {
	m.transpose(m.wT, w, in, outC)
	m.gj = gemmJob[F]{tB: true, m: m.bt, n: outC, k: in, a: inp, lda: in, b: m.wT, ldb: in, c: out, ldc: outC, bias: bias,
		tilesN: (outC + tileN - 1) / tileN}
	m.pool.run((m.bt+tileM-1)/tileM*m.gj.tilesN, m.fnGemm)
	m.gj = gemmJob[F]{}
}

// linearBackward is linear's backward: dinp = dout @ wᵀ (overwritten),
// dw = inpᵀ @ dout and db = the column sums of dout (overwritten).
func (m *Model[F]) linearBackward(dinp, dw, db, dout, inp, w []F, in, outC int) {
	m.matmul(false, true, m.bt, in, outC, dout, outC, w, outC, 0, dinp, in)
	m.transpose(m.aT, inp, m.bt, in)
	m.transpose(m.yT, dout, m.bt, outC)
	m.matmul(false, true, in, outC, m.bt, m.aT, m.bt, m.yT, m.bt, 0, dw, outC)
	m.k.dout, m.k.db, m.k.cols = dout, db, outC
	m.pool.run((outC+colsPerTask-1)/colsPerTask, m.fnColSum)
}

// layerNorm computes out = (inp - mean) * rstd * w + bias per row of [BT, C]
// and keeps mean and rstd = 1/sqrt(var + eps) (biased variance) per row.
func (m *Model[F]) layerNorm(out, mean, rstd, inp, w, bias []F) {
	m.k.out, m.k.mean, m.k.rstd, m.k.inp, m.k.w, m.k.bias = out, mean, rstd, inp, w, bias
	m.runRows(m.fnLnFwd)
}

// layerNormBackward adds the gradient with respect to inp to dinp and
// overwrites dw and db, from dout, the gradient of the LayerNorm's output.
func (m *Model[F]) layerNormBackward(dinp, dw, db, dout, inp, w, mean, rstd []F) {
	m.k.dinp, m.k.dw, m.k.db, m.k.dout, m.k.inp, m.k.w, m.k.mean, m.k.rstd = dinp, dw, db, dout, inp, w, mean, rstd
	m.runRows(m.fnLnBwdRows)
	m.pool.run((m.cfg.NEmbd+colsPerTask-1)/colsPerTask, m.fnLnBwdCols)
}

// transpose sets dst [cols, rows] to srcᵀ, src [rows, cols], on the pool.
func (m *Model[F]) transpose(dst, src []F, rows, cols int) {
	m.tj = transposeJob[F]{dst: dst, src: src, rows: rows, cols: cols}
	m.pool.run((cols+transposeBlock-1)/transposeBlock, m.fnTranspose)
	m.tj = transposeJob[F]{}
}

// add sets dst = a + b elementwise.
func add[F float32 | float64](dst, a, b []F) {
	b = b[:len(dst)]
	a = a[:len(dst)]
	for i := range dst {
		dst[i] = a[i] + b[i]
	}
}

func (m *Model[F]) lnFwdTask(i, _ int) {
	k, C := &m.k, m.cfg.NEmbd
	w, bias := k.w[:C], k.bias[:C]
	r0, r1 := m.rowRange(i)
	for r := r0; r < r1; r++ {
		x, out := k.inp[r*C:][:C], k.out[r*C:][:C]
		var s F
		for _, v := range x {
			s += v
		}
		mean := s / F(C)
		var ss F
		for _, v := range x {
			d := v - mean
			ss += d * d
		}
		rstd := F(1 / math.Sqrt(float64(ss/F(C)+LayerNormEps)))
		for j, v := range x {
			out[j] = (v-mean)*rstd*w[j] + bias[j]
		}
		k.mean[r], k.rstd[r] = mean, rstd
	}
}

func (m *Model[F]) lnBwdRowsTask(i, _ int) {
	k, C := &m.k, m.cfg.NEmbd
	w := k.w[:C]
	r0, r1 := m.rowRange(i)
	for r := r0; r < r1; r++ {
		x, dout, dinp := k.inp[r*C:][:C], k.dout[r*C:][:C], k.dinp[r*C:][:C]
		mean, rstd := k.mean[r], k.rstd[r]
		var sumD, sumDN F
		for j, v := range x {
			dn := w[j] * dout[j]
			sumD += dn
			sumDN += dn * (v - mean) * rstd
		}
		sumD /= F(C)
		sumDN /= F(C)
		for j, v := range x {
			norm := (v - mean) * rstd
			dinp[j] += (w[j]*dout[j] - sumD - norm*sumDN) * rstd
		}
	}
}

func (m *Model[F]) lnBwdColsTask(i, _ int) {
	k, C := &m.k, m.cfg.NEmbd
	c0, c1 := i*colsPerTask, min((i+1)*colsPerTask, C)
	dw, db := k.dw[c0:c1], k.db[c0:c1]
	clear(dw)
	clear(db)
	for r := 0; r < m.bt; r++ {
		x, dout := k.inp[r*C+c0:][:len(dw)], k.dout[r*C+c0:][:len(dw)]
		mean, rstd := k.mean[r], k.rstd[r]
		for j, v := range x {
			dw[j] += (v - mean) * rstd * dout[j]
			db[j] += dout[j]
		}
	}
}

// colSumTask sets db[c] = sum over rows r, in order, of dout[r, c].
func (m *Model[F]) colSumTask(i, _ int) {
	k, n := &m.k, m.k.cols
	c0, c1 := i*colsPerTask, min((i+1)*colsPerTask, n)
	db := k.db[c0:c1]
	clear(db)
	for r := 0; r < m.bt; r++ {
		d := k.dout[r*n+c0:][:len(db)]
		for j, v := range d {
			db[j] += v
		}
	}
}

// attnScratch is one goroutine's scratch for attention's backward (and vT
// for its forward).
type attnScratch[F float32 | float64] struct {
	d, dT, pT       []F // [T, T]: d score (after d att), its transpose, att's transpose
	qT, kT, vT, doT []F // [hs, T]: one head's q, k, v and d atty, transposed
}

func newAttnScratch[F float32 | float64](T, hs int) attnScratch[F] {
	return attnScratch[F]{
		d: make([]F, T*T), dT: make([]F, T*T), pT: make([]F, T*T),
		qT: make([]F, hs*T), kT: make([]F, hs*T), vT: make([]F, hs*T), doT: make([]F, hs*T),
	}
}

// attnRows is the row block of attention's products: block [t0, t1) of
// queries only meets keys [0, t1), so the causal mask skips about
// (1 - attnRows/T)/2 of the work.
const attnRows = 16

// runAttn runs fn over the B*NHead (sequence, head) pairs, with one
// attnScratch per goroutine.
func (m *Model[F]) runAttn(fn func(i, w int)) {
	n := m.b * m.cfg.NHead
	threads := m.pool.threads(n)
	for len(m.scratch) < threads { // only when GOMAXPROCS has grown since NewModel
		m.scratch = append(m.scratch, newAttnScratch[F](m.t, m.hs))
	}
	m.pool.runOn(n, threads, fn)
}

// transposeInto sets dst [cols, rows] to the transpose of the rows×cols
// matrix at src with row stride lds.
func transposeInto[F float32 | float64](dst, src []F, rows, cols, lds int) {
	for r := 0; r < rows; r++ {
		row := src[r*lds:][:cols]
		for c, x := range row {
			dst[c*rows+r] = x
		}
	}
}

// attnFwdTask computes causal self-attention for task = b*NHead + h of layer
// k.l, as HF GPT2Attention._attn: att[t, t2] = softmax over t2 <= t of
// q_t·k_t2/sqrt(hs) (0 for t2 > t), and atty[b, t, head h] = sum over t2 of
// att[t, t2] v_t2. The products run through gemm in row blocks.
func (m *Model[F]) attnFwdTask(task, w int) {
	c := m.cfg
	T, C, NH, hs, BT := m.t, c.NEmbd, c.NHead, m.hs, m.bt
	C3 := 3 * C
	b, h := task/NH, task%NH
	l := m.k.l
	qkv := m.qkv[l*BT*C3 : (l+1)*BT*C3]
	base := b*T*C3 + h*hs // row t of head h's q at base + t*C3; k at +C, v at +2C
	q, k, v := qkv[base:], qkv[base+C:], qkv[base+2*C:]
	att := m.att[((l*m.b+b)*NH+h)*T*T:][:T*T]
	out := m.atty[l*BT*C+b*T*C+h*hs:] // row t at t*C
	s := &m.scratch[w]
	transposeInto(s.vT, v, T, hs, C3)
	scale := 1 / F(math.Sqrt(float64(hs)))
	for t0 := 0; t0 < T; t0 += attnRows {
		t1 := min(t0+attnRows, T)
		gemmSerial(false, true, t1-t0, t1, hs, q[t0*C3:], C3, k, C3, 0, att[t0*T:], T) // scores = q kᵀ
		for t := t0; t < t1; t++ {
			row := att[t*T : t*T+t+1]
			maxv := F(math.Inf(-1))
			for t2, x := range row {
				row[t2] = x * scale
				maxv = max(maxv, row[t2])
			}
			var sum F
			for t2, x := range row {
				e := F(math.Exp(float64(x - maxv)))
				row[t2] = e
				sum += e
			}
			inv := 1 / sum
			for t2 := range row {
				row[t2] *= inv
			}
			clear(att[t*T+t+1 : t*T+t1]) // masked; beyond t1 stays 0 from NewModel
		}
		gemmSerial(false, true, t1-t0, hs, t1, att[t0*T:], T, s.vT, T, 0, out[t0*C:], C) // atty = att v
	}
}

// attnBwdTask is attnFwdTask's backward for task = b*NHead + h of layer k.l:
// from k.dout (d atty, [BT, C]) it overwrites the q, k and v columns of head
// h in the rows of sequence b of k.dinp (d qkv, [BT, 3C]):
//
//	d att = d atty vᵀ; d score = att ⊙ (d att - rowsum(att ⊙ d att)) / sqrt(hs);
//	d q = d score k; d k = d scoreᵀ q; d v = attᵀ d atty.
func (m *Model[F]) attnBwdTask(task, w int) {
	c := m.cfg
	T, C, NH, hs, BT := m.t, c.NEmbd, c.NHead, m.hs, m.bt
	C3 := 3 * C
	b, h := task/NH, task%NH
	l := m.k.l
	qkv := m.qkv[l*BT*C3 : (l+1)*BT*C3]
	base := b*T*C3 + h*hs
	q, k, v := qkv[base:], qkv[base+C:], qkv[base+2*C:]
	dq, dk, dv := m.k.dinp[base:], m.k.dinp[base+C:], m.k.dinp[base+2*C:]
	dout := m.k.dout[b*T*C+h*hs:] // row t at t*C
	att := m.att[((l*m.b+b)*NH+h)*T*T:][:T*T]
	s := &m.scratch[w]
	scale := 1 / F(math.Sqrt(float64(hs)))
	transposeInto(s.kT, k, T, hs, C3)
	for t0 := 0; t0 < T; t0 += attnRows {
		t1 := min(t0+attnRows, T)
		gemmSerial(false, true, t1-t0, t1, hs, dout[t0*C:], C, v, C3, 0, s.d[t0*T:], T) // d att = d atty vᵀ
		for t := t0; t < t1; t++ {
			p, d := att[t*T:t*T+t+1], s.d[t*T:(t+1)*T]
			var sum F
			for t2, x := range p {
				sum += x * d[t2]
			}
			for t2, x := range p {
				d[t2] = x * (d[t2] - sum) * scale
			}
			clear(d[t+1:])
		}
		gemmSerial(false, true, t1-t0, hs, t1, s.d[t0*T:], T, s.kT, T, 0, dq[t0*C3:], C3) // d q = d score k
	}
	// Rows [s0, s1) of d k and d v sum over queries t >= s0 (the others are
	// masked).
	transposeInto(s.dT, s.d, T, T, T)
	transposeInto(s.pT, att, T, T, T)
	transposeInto(s.qT, q, T, hs, C3)
	transposeInto(s.doT, dout, T, hs, C)
	for s0 := 0; s0 < T; s0 += attnRows {
		s1 := min(s0+attnRows, T)
		gemmSerial(false, true, s1-s0, hs, T-s0, s.dT[s0*T+s0:], T, s.qT[s0:], T, 0, dk[s0*C3:], C3)  // d k = d scoreᵀ q
		gemmSerial(false, true, s1-s0, hs, T-s0, s.pT[s0*T+s0:], T, s.doT[s0:], T, 0, dv[s0*C3:], C3) // d v = attᵀ d atty
	}
}

// GELU, tanh approximation (HF NewGELUActivation, "gelu_new"):
// 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x³))).
const (
	geluS = 0.7978845608028654 // sqrt(2/pi)
	geluC = 0.044715
)

func (m *Model[F]) geluFwdTask(i, _ int) {
	k := &m.k
	r0, r1 := m.rowRange(i)
	x, y := k.inp[r0*k.cols:r1*k.cols], k.out[r0*k.cols:r1*k.cols]
	for j, v := range x {
		u := geluS * (v + geluC*v*v*v)
		y[j] = 0.5 * v * (1 + F(math.Tanh(float64(u))))
	}
}

// geluBwdTask multiplies k.dout in place by GELU's derivative at k.inp.
func (m *Model[F]) geluBwdTask(i, _ int) {
	k := &m.k
	r0, r1 := m.rowRange(i)
	x, d := k.inp[r0*k.cols:r1*k.cols], k.dout[r0*k.cols:r1*k.cols]
	for j, v := range x {
		u := geluS * (v + geluC*v*v*v)
		th := F(math.Tanh(float64(u)))
		sech2 := 1 - th*th
		d[j] *= 0.5*(1+th) + 0.5*v*sech2*geluS*(1+3*geluC*v*v)
	}
}

// ceTask computes each row's log-sum-exp (shifted by the row's maximum) and
// cross-entropy lse - logit[target], in float64.
func (m *Model[F]) ceTask(i, _ int) {
	V := m.cfg.VocabSize
	r0, r1 := m.rowRange(i)
	for r := r0; r < r1; r++ {
		row := m.logits[r*V:][:V]
		maxv := row[0]
		for _, v := range row {
			maxv = max(maxv, v)
		}
		var sum float64
		for _, v := range row {
			sum += math.Exp(float64(v - maxv))
		}
		lse := float64(maxv) + math.Log(sum)
		m.lse[r] = lse
		m.losses[r] = lse - float64(row[m.targets[r]])
	}
}

// ceBwdTask writes d(scale*loss)/d logits = (softmax - onehot(target)) *
// scale/BT.
func (m *Model[F]) ceBwdTask(i, _ int) {
	V, d := m.cfg.VocabSize, m.k.dloss
	r0, r1 := m.rowRange(i)
	for r := r0; r < r1; r++ {
		row, dl, lse := m.logits[r*V:][:V], m.dlogits[r*V:][:V], m.lse[r]
		for j, v := range row {
			dl[j] = F(math.Exp(float64(v)-lse)) * d
		}
		tg := m.targets[r]
		dl[tg] = (F(math.Exp(float64(row[tg])-lse)) - 1) * d
	}
}
