package scheduler

import (
	"fmt"
	"strings"

	"github.com/deepstates/dos/perfmodel"
)

// The schedule core: the one place where the update phase's rules live.
//
// newCore turns a plan into the steps of one update phase, each with the
// lane that issues it, where it runs, its subgroup, staging slot and piece,
// and the steps it waits for, the copy throttle among them. It starts no
// goroutine, reads no clock and touches no device (as etcd-io/raft's
// RawNode: its user does the work). Two users drive it:
//
//   - Engine.Update executes it on a Device: one goroutine per issuer walks
//     that issuer's steps in order, waits for each step's dependencies as
//     the step says (on the host, on the device, or both), then enqueues
//     it (lanes.go).
//   - Simulate replays it in virtual time with a profile's rates: each step
//     is ready once every step it waits for has ended, and each resource
//     serves its ready steps first come first served (simulate.go).
//
// TestGolden prints the steps of small plans (testdata/*.txt) and
// TestEngineAgreesWithReplay checks, on the simulated device, that the
// engine issues exactly these steps in an order that respects every
// dependency, and that the replay does too.

// Operations of a subgroup: a GPU subgroup runs opH2D, opKernel, opD2H; a
// resident one opKernel; a CPU one opUpcast (with the GPU upcast),
// opGradD2H, opCPU, opCopyH2D; a host-held one (Options.HostHeld) opCPU
// alone.
const (
	opH2D = iota
	opKernel
	opD2H
	opUpcast
	opGradD2H
	opCPU
	opCopyH2D
	numOps
)

var opNames = [numOps]string{"state H2D", "AdamW", "state D2H", "upcast", "grad D2H", "CPU AdamW", "copy H2D"}

// The operations of each role, in order.
var (
	gpuOps       = []int{opH2D, opKernel, opD2H}
	residentOps  = []int{opKernel}
	cpuOps       = []int{opGradD2H, opCPU, opCopyH2D}
	cpuUpcastOps = []int{opUpcast, opGradD2H, opCPU, opCopyH2D}
	heldOps      = []int{opCPU}
)

// Queues: where a step runs. The first four are the engine's streams.
const (
	sH2D    = iota // the H2D lane: every H2D copy, in the order enqueued
	sKernel        // the fused AdamW kernels
	sD2H           // the D2H lane: every D2H copy
	sUpcast        // the casts of CPU subgroups' gradients
	qCPU           // the CPU workers
	numQueues
)

var queueNames = [numQueues]string{"h2d", "kernel", "d2h", "upcast", "cpu"}

// issuer is who issues a step in the engine: one goroutine each.
type issuer uint8

const (
	issGPU   issuer = iota // the GPU lane: state H2D pieces and kernels (Update's own goroutine)
	issDrain               // the GPU lane's state D2H pieces
	issFeed                // the CPU lane's upcasts and gradient D2H copies
	issWork                // the CPU lane's updates (the workers) and copy H2D copies
	numIssuers
)

var issuerNames = [numIssuers]string{"gpu", "drain", "feed", "work"}

// waitMode says how the engine makes a step wait for one it depends on.
// The replay treats every mode alike: the step is ready once the other
// has ended.
type waitMode uint8

const (
	// waitOrder: already ordered, nothing to do: the same stream, or the
	// same issuer after a wait of an earlier step.
	waitOrder waitMode = iota
	// waitHost: the issuer blocks until the other step is done (its end
	// event, or a CPU step's return), so that a copy is enqueued only when
	// it can run: copies of one direction share a copy engine in the order
	// enqueued, and one waiting on an event would hold up the others.
	waitHost
	// waitStream: the step's stream waits for the other's end event on
	// the device.
	waitStream
	// waitBoth: both (the stream wait is then a no-op on CUDA; it tells
	// the simulated device's clock).
	waitBoth
	// waitThrottle: the copy throttle: a state piece is enqueued only once
	// the lane's piece two before it is done (a host wait), so at most one
	// piece waits in the lane and a CPU subgroup's copy enqueued meanwhile
	// waits for at most two.
	waitThrottle
)

var waitNames = [...]string{"order", "host", "stream", "host+stream", "throttle"}

func (w waitMode) host() bool   { return w == waitHost || w == waitBoth || w == waitThrottle }
func (w waitMode) stream() bool { return w == waitStream || w == waitBoth }

// dep is one step another waits for.
type dep struct {
	step int32
	how  waitMode
}

// maxDeps bounds a step's dependencies (a CPU update has three).
const maxDeps = 3

// step is one operation of the update phase, or one piece of a state copy.
type step struct {
	op     uint8  // opH2D ... opCopyH2D
	queue  uint8  // sH2D ... qCPU
	issuer issuer // who issues it in the engine
	slot   int8   // staging slot (0 or 1); -1 for a resident kernel
	array  int8   // state copies: p, m, v, vmax (0-3); -1 otherwise
	first  bool   // the first step of its operation
	last   bool   // the last step of its operation
	nDeps  uint8
	sub    int32 // the subgroup
	seq    int32 // its position among its issuer's steps
	head   int32 // the first step of its operation
	off    int64 // state copies: byte offset into the subgroup's array
	amount int64 // bytes moved (copies) or parameters updated (kernels, upcasts, CPU updates)
	deps   [maxDeps]dep
}

// Deps returns what st waits for.
func (st *step) waits() []dep { return st.deps[:st.nDeps] }

// shape is what the core needs besides the plan.
type shape struct {
	sizes     []int64 // parameters per subgroup, > 0 each
	arrays    int     // state arrays: 3, or 4 with amsgrad
	gradBytes int64   // bytes per element of the device gradient: 4 or 2
	chunk     int64   // bytes per state piece; 0 means CopyChunk
	held      []bool  // per subgroup: host-held (Options.HostHeld); nil for none
}

// core is the steps of one update phase over a plan.
type core struct {
	plan     *Plan
	shape    shape
	upcast   bool  // CPU subgroups' 16-bit gradients widen on the device first
	cpuGradB int64 // bytes per element of a CPU subgroup's gradient D2H
	steps    []step
	lanes    [numIssuers][]int32 // each issuer's steps, in order
	opSteps  [][numOps][2]int32  // per subgroup and operation: first and last step, -1 for none
	numHeads int                 // operations (steps with first set)
	// slotPrev is, per step, for a CPU subgroup's copy H2D the copy H2D
	// before it from the same copy staging slot, and for the last piece
	// of a streamed subgroup's state D2H the last piece of the state D2H
	// before it from the same device staging slot (-1: none, and for
	// every other step): what the slot waits for when a kept speculative
	// update skips that copy in the phase (Engine.slotStep).
	slotPrev  []int32
	throttled [numQueues][]int32 // state pieces per copy lane, for the throttle
}

// CopyChunk is the size in bytes of the pieces a state copy is cut into.
const CopyChunk = 64 << 20

// newCore returns the steps of an update phase over p for sh. They come in
// the order the replay breaks ties in: the GPU lane (in p.GPUOrder: a
// resident subgroup's kernel; a streamed one's state H2D pieces, kernel,
// state D2H pieces), then the CPU lane (in p.CPUOrder: the upcast, the
// gradient D2H, the update, the copy H2D). Every dependency points to an
// earlier step, and each issuer's steps come in its order, so the engine
// cannot deadlock.
//
// The rules, each a dependency (waitMode says how the engine keeps it):
//   - a streamed subgroup's state moves H2D into staging slot j%2 (j: its
//     rank among the streamed ones) after the slot's previous state moved
//     D2H (host and stream; when a kept speculative update on the GPU
//     skips that copy in the phase, the last one from the slot before it:
//     Engine.slotStep); its kernel after the state H2D (stream); its
//     state D2H after the kernel (host and stream); kernels run in the GPU
//     lane's order (one stream);
//   - state copies move in pieces of chunk bytes, each after the piece two
//     before it on its lane (the throttle);
//   - a CPU subgroup c of the CPU lane uses host slot c%2: its upcast (or,
//     without one, its gradient D2H) waits until the update of subgroup c-2
//     has read the slot (host); the gradient D2H after the upcast (host and
//     stream); the update after the gradient D2H (host), after the copy H2D
//     of subgroup c-2 left the copy slot (host; when a kept speculative
//     update skips that copy in the phase, the last copy from the slot
//     before it: Engine.slotStep), after the update before it (the workers
//     run one at a time); the copy H2D after the update;
//   - a host-held subgroup (not in p's orders) is updated by the CPU
//     workers before the CPU lane's first, in subgroup order.
//
// It panics on a plan that does not match sh (a programmer error).
func newCore(p *Plan, sh shape) *core {
	n := len(sh.sizes)
	if len(p.Roles) != n {
		panic(fmt.Sprintf("scheduler: a plan of %d subgroups for %d sizes", len(p.Roles), n))
	}
	if sh.chunk <= 0 {
		sh.chunk = CopyChunk
	}
	c := &core{plan: p, shape: sh, cpuGradB: sh.gradBytes}
	c.upcast = p.Schedule.UpcastOnGPU && sh.gradBytes == 2
	if c.upcast {
		c.cpuGradB = 4
	}
	c.opSteps = make([][numOps][2]int32, n)
	for i := range c.opSteps {
		for op := range numOps {
			c.opSteps[i][op] = [2]int32{-1, -1}
		}
	}
	// The GPU lane.
	lastOnSlot := [2]int32{-1, -1}
	prevKernel := int32(-1)
	streamed := 0
	var drains [][2]int32 // each streamed subgroup's last state D2H piece, and the one before it on its slot
	for _, i := range p.GPUOrder {
		n := sh.sizes[i]
		if p.Roles[i] == Resident {
			prevKernel = c.add(step{op: opKernel, queue: sKernel, issuer: issGPU, slot: -1, array: -1, sub: int32(i), amount: n},
				dep{prevKernel, waitOrder})
			continue
		}
		slot := int8(streamed % 2)
		streamed++
		h2d := c.stateCopy(opH2D, sH2D, issGPU, i, slot, dep{lastOnSlot[slot], waitBoth})
		prevKernel = c.add(step{op: opKernel, queue: sKernel, issuer: issGPU, slot: slot, array: -1, sub: int32(i), amount: n},
			dep{h2d, waitStream}, dep{prevKernel, waitOrder})
		d2h := c.stateCopy(opD2H, sD2H, issDrain, i, slot, dep{prevKernel, waitBoth})
		drains = append(drains, [2]int32{d2h, lastOnSlot[slot]})
		lastOnSlot[slot] = d2h
	}
	// The CPU lane: the host-held subgroups first, in order (their
	// gradients and working copy are on the host: nothing to wait for).
	prevCPU := int32(-1)
	for i, held := range sh.held {
		if held {
			prevCPU = c.add(step{op: opCPU, queue: qCPU, issuer: issWork, slot: -1, array: -1, sub: int32(i), amount: sh.sizes[i]},
				dep{prevCPU, waitOrder})
		}
	}
	var updates, copies []int32
	for ci, i := range p.CPUOrder {
		n := sh.sizes[i]
		slot := int8(ci % 2)
		token, slotFree := int32(-1), int32(-1)
		if ci >= 2 {
			token, slotFree = updates[ci-2], copies[ci-2]
		}
		sub := int32(i)
		var gd int32
		if c.upcast {
			u := c.add(step{op: opUpcast, queue: sUpcast, issuer: issFeed, slot: slot, array: -1, sub: sub, amount: n}, dep{token, waitHost})
			gd = c.add(step{op: opGradD2H, queue: sD2H, issuer: issFeed, slot: slot, array: -1, sub: sub, amount: c.cpuGradB * n}, dep{u, waitBoth})
		} else {
			gd = c.add(step{op: opGradD2H, queue: sD2H, issuer: issFeed, slot: slot, array: -1, sub: sub, amount: c.cpuGradB * n}, dep{token, waitHost})
		}
		prevCPU = c.add(step{op: opCPU, queue: qCPU, issuer: issWork, slot: slot, array: -1, sub: sub, amount: n},
			dep{gd, waitHost}, dep{slotFree, waitHost}, dep{prevCPU, waitOrder})
		cp := c.add(step{op: opCopyH2D, queue: sH2D, issuer: issWork, slot: slot, array: -1, sub: sub, amount: 2 * n}, dep{prevCPU, waitOrder})
		updates, copies = append(updates, prevCPU), append(copies, cp)
	}
	c.slotPrev = make([]int32, len(c.steps))
	for k := range c.slotPrev {
		c.slotPrev[k] = -1
	}
	for ci := 2; ci < len(copies); ci++ {
		c.slotPrev[copies[ci]] = copies[ci-2]
	}
	for _, d := range drains {
		c.slotPrev[d[0]] = d[1]
	}
	c.throttled = [numQueues][]int32{} // only for building
	return c
}

// stateCopy adds the pieces of subgroup i's state copy on lane queue q
// (every array in pieces of chunk bytes; after d, with d's mode on the
// first piece, already kept on the others) and returns the last piece.
func (c *core) stateCopy(op uint8, q uint8, by issuer, i int, slot int8, d dep) int32 {
	b := 4 * c.shape.sizes[i]
	last := int32(-1)
	for a := range c.shape.arrays {
		for o := int64(0); o < b; o += c.shape.chunk {
			first := a == 0 && o == 0
			dd := d
			if !first {
				dd.how = waitOrder
			}
			st := step{op: op, queue: q, issuer: by, slot: slot, array: int8(a), sub: int32(i), off: o, amount: min(c.shape.chunk, b-o),
				last: a == c.shape.arrays-1 && o+c.shape.chunk >= b}
			th := dep{-1, waitThrottle}
			if k := len(c.throttled[q]); k >= 2 {
				th.step = c.throttled[q][k-2]
			}
			last = c.add(st, dd, th)
			c.throttled[q] = append(c.throttled[q], last)
		}
	}
	return last
}

// add appends st with the dependencies that exist (step >= 0) and returns
// its index; it marks the first step of an operation.
func (c *core) add(st step, deps ...dep) int32 {
	k := int32(len(c.steps))
	for _, d := range deps {
		if d.step >= 0 {
			st.deps[st.nDeps] = d
			st.nDeps++
		}
	}
	r := &c.opSteps[st.sub][st.op]
	if r[0] < 0 {
		r[0] = k
		st.first = true
		c.numHeads++
	}
	if st.array < 0 {
		st.last = true
	}
	if st.last {
		r[1] = k
	}
	st.head = r[0]
	st.seq = int32(len(c.lanes[st.issuer]))
	c.lanes[st.issuer] = append(c.lanes[st.issuer], k)
	c.steps = append(c.steps, st)
	return k
}

// readyStep returns the step after which subgroup i's new 16-bit working
// copy and its mirror part are written: a host-held subgroup's CPU update,
// a CPU subgroup's copy H2D, another's kernel (the mirror's copies follow
// it on its stream, before its end event).
func (c *core) readyStep(i int) int32 {
	op := opKernel
	switch {
	case c.shape.held != nil && c.shape.held[i]:
		op = opCPU
	case c.plan.Roles[i] == OnCPU:
		op = opCopyH2D
	}
	return c.opSteps[i][op][1]
}

// ops returns subgroup i's operations in order.
func (c *core) ops(i int) []int {
	if c.shape.held != nil && c.shape.held[i] {
		return heldOps
	}
	switch c.plan.Roles[i] {
	case OnGPU:
		return gpuOps
	case Resident:
		return residentOps
	}
	if c.upcast {
		return cpuUpcastOps
	}
	return cpuOps
}

// resource returns the perfmodel resource that queue q uses.
func resource(q uint8) perfmodel.Resource {
	switch q {
	case sH2D:
		return perfmodel.ResH2D
	case sD2H:
		return perfmodel.ResD2H
	case qCPU:
		return perfmodel.ResCPU
	}
	return perfmodel.ResGPU
}

// describe writes step k in the golden traces' format, e.g.
//
//	#4 gpu h2d state H2D sg 1 slot 0 p[0,16) 16 B after #2 host+stream, #3 throttle
func (c *core) describe(k int32) string {
	st := &c.steps[k]
	var b strings.Builder
	fmt.Fprintf(&b, "#%d %s %s %s sg %d", k, issuerNames[st.issuer], queueNames[st.queue], opNames[st.op], st.sub)
	if st.slot >= 0 {
		fmt.Fprintf(&b, " slot %d", st.slot)
	}
	unit := "params"
	if st.array >= 0 {
		fmt.Fprintf(&b, " %c[%d,%d)", "pmvx"[st.array], st.off, st.off+st.amount)
	}
	if st.op == opH2D || st.op == opD2H || st.op == opGradD2H || st.op == opCopyH2D {
		unit = "B"
	}
	fmt.Fprintf(&b, " %d %s", st.amount, unit)
	for j, d := range st.waits() {
		if j == 0 {
			b.WriteString(" after")
		} else {
			b.WriteString(",")
		}
		fmt.Fprintf(&b, " #%d %s", d.step, waitNames[d.how])
	}
	return b.String()
}
