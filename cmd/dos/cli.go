package main

import (
	"errors"
	"flag"
	"fmt"
	"io"
	"math"
	"math/big"
	"regexp"
	"strconv"
	"strings"
)

// cli is the flag set of one dos subcommand, parsed the same way by every
// one of them:
//
//   - flags may stand anywhere among the positional arguments (a lone --
//     ends the flags);
//   - -h, -help or --help prints the help (the synopsis, what the command
//     does, its flags) to stdout, and the command exits 0;
//   - a usage error (an unknown flag, a bad value, a missing or extra
//     argument) prints one line naming it and the synopsis to stderr, and
//     the command exits 2 (usageError);
//   - a runtime failure (no GPU, I/O, a damaged checkpoint) prints one line
//     to stderr and the command exits 1 (fail).
type cli struct {
	*flag.FlagSet
	synopsis string // "dos plan --profile PATH [flags]"
	about    string // what the command does, printed by -h before the flags
	hidden   map[string]bool
}

// newCLI returns the flag set of the command name ("dos plan").
func newCLI(name, synopsis, about string) *cli {
	fs := flag.NewFlagSet(name, flag.ContinueOnError)
	fs.SetOutput(io.Discard) // parse reports errors itself
	fs.Usage = func() {}
	return &cli{FlagSet: fs, synopsis: synopsis, about: about, hidden: map[string]bool{}}
}

// alias makes alias a hidden second name of the flag name: it sets the
// same value and is left out of the help.
func (c *cli) alias(alias, name string) {
	f := c.Lookup(name)
	if f == nil {
		panic("dos: alias of an undefined flag " + name)
	}
	c.Var(f.Value, alias, f.Usage)
	c.hidden[alias] = true
}

// parse parses args. It returns the positional arguments and ok; when ok
// is false the command returns rc: 0 after printing the help to stdout
// (-h), 2 after a usage error printed to stderr.
func (c *cli) parse(args []string, stdout, stderr io.Writer) (pos []string, rc int, ok bool) {
	for {
		err := c.Parse(args)
		if errors.Is(err, flag.ErrHelp) {
			c.help(stdout)
			return nil, 0, false
		}
		if err != nil {
			return nil, c.usageError(stderr, "%s%s", flagError(err), c.suggest(err)), false
		}
		if c.NArg() == 0 {
			return pos, 0, true
		}
		if used := len(args) - c.NArg(); used > 0 && args[used-1] == "--" {
			return append(pos, c.Args()...), 0, true
		}
		pos = append(pos, c.Arg(0))
		args = c.Args()[1:]
	}
}

// invalidValue matches the flag package's error for a value that Set
// refused; invalidBool its error for a boolean flag's value.
var (
	invalidValue = regexp.MustCompile(`^invalid value ("(?:[^"\\]|\\.)*") for flag -(\S+): (.*)$`)
	invalidBool  = regexp.MustCompile(`^invalid boolean value ("(?:[^"\\]|\\.)*") for -(\S+): (.*)$`)
)

// flagError spells a parse error of the flag package as the rest of dos
// does: "--batch 1.5: not a whole number".
func flagError(err error) string {
	msg := err.Error()
	if m := invalidBool.FindStringSubmatch(msg); m != nil {
		if v, uerr := strconv.Unquote(m[1]); uerr == nil {
			return fmt.Sprintf("--%s=%s: want true or false (--%s alone is true; --%s=false turns it off)", m[2], v, m[2], m[2])
		}
	}
	if m := invalidValue.FindStringSubmatch(msg); m != nil {
		if v, uerr := strconv.Unquote(m[1]); uerr == nil {
			return fmt.Sprintf("--%s %s: %s", m[2], v, numberError(v, m[3]))
		}
	}
	return msg
}

// numberError says why a number flag refused v, from the flag package's
// reason: strconv's "parse error" for a value that is not an integer in
// the flag's syntax (a fraction, an exponent, a sign a count cannot have,
// a unit), "value out of range".
func numberError(v, why string) string {
	switch why {
	case "parse error":
		f, err := strconv.ParseFloat(v, 64)
		switch {
		case errors.Is(err, strconv.ErrRange) || math.IsInf(f, 0):
			return "out of range for the flag"
		case err != nil:
			return "not a number (give the number alone: the flag's unit is in its name or its -h line)"
		case f != math.Trunc(f): // a fraction or NaN
			return "not a whole number"
		case f < 0:
			return "want a whole number >= 0"
		default: // 1e3
			return fmt.Sprintf("write the whole number in digits (%.0f)", f)
		}
	case "value out of range":
		return "out of range for the flag"
	}
	return why
}

// undefinedFlag matches the flag package's error for a flag the set does
// not define.
var undefinedFlag = regexp.MustCompile(`^flag provided but not defined: -(\S+)$`)

// suggest returns, for a parse error naming a flag the command does not
// define, " (did you mean --steps?)" naming the defined flags nearest to
// it (nearFlags), or "" when none is near.
func (c *cli) suggest(err error) string {
	m := undefinedFlag.FindStringSubmatch(err.Error())
	if m == nil {
		return ""
	}
	var names []string
	c.VisitAll(func(f *flag.Flag) { names = append(names, f.Name) })
	near := nearFlags(strings.TrimLeft(m[1], "-"), names, c.hidden)
	if len(near) == 0 {
		return ""
	}
	for i, n := range near {
		near[i] = "--" + n
	}
	if len(near) == 1 {
		return " (did you mean " + near[0] + "?)"
	}
	return " (did you mean " + strings.Join(near[:len(near)-1], ", ") + " or " + near[len(near)-1] + "?)"
}

// nearFlags returns the flag names (hidden aliases left out) nearest to
// the unknown name given, at most three, in the order of names: those
// within an edit distance of 1 (2 for names of 5 letters or more), or else
// those of which given is a prefix (--ckpt: --ckpt-dir, --ckpt-every, ...)
// or that are a prefix of given (--stepsize: --steps). A -name=value typo
// is matched on the name alone.
func nearFlags(given string, names []string, hidden map[string]bool) []string {
	given, _, _ = strings.Cut(given, "=")
	if given == "" {
		return nil
	}
	limit := 1
	if len(given) >= 6 {
		limit = 2
	}
	var best []string
	bestD := limit + 1
	var prefixed []string
	for _, n := range names {
		if hidden[n] {
			continue
		}
		switch d := editDistance(strings.ToLower(given), n); {
		case d < bestD:
			best, bestD = []string{n}, d
		case d == bestD:
			best = append(best, n)
		}
		if len(given) >= 2 && (strings.HasPrefix(n, given) || strings.HasPrefix(given, n) && len(n) >= 3) {
			prefixed = append(prefixed, n)
		}
	}
	if len(best) == 0 {
		best = prefixed
	}
	if len(best) > 3 {
		best = best[:3]
	}
	return best
}

// editDistance is the optimal string alignment distance between a and b:
// the fewest insertions, deletions, substitutions and swaps of adjacent
// bytes that turn a into b (a swapped pair counts 1: stpes is 1 from
// steps).
func editDistance(a, b string) int {
	d := make([][]int, len(a)+1)
	for i := range d {
		d[i] = make([]int, len(b)+1)
		d[i][0] = i
	}
	for j := range d[0] {
		d[0][j] = j
	}
	for i := 1; i <= len(a); i++ {
		for j := 1; j <= len(b); j++ {
			sub := d[i-1][j-1]
			if a[i-1] != b[j-1] {
				sub++
			}
			d[i][j] = min(sub, d[i-1][j]+1, d[i][j-1]+1)
			if i > 1 && j > 1 && a[i-1] == b[j-2] && a[i-2] == b[j-1] {
				d[i][j] = min(d[i][j], d[i-2][j-2]+1)
			}
		}
	}
	return d[len(a)][len(b)]
}

// parseNoArgs is parse for a command that takes no positional arguments.
func (c *cli) parseNoArgs(args []string, stdout, stderr io.Writer) (rc int, ok bool) {
	pos, rc, ok := c.parse(args, stdout, stderr)
	if ok && len(pos) > 0 {
		if k := len(args) - len(pos) - 1; (pos[0] == "true" || pos[0] == "false") && k >= 0 && strings.HasPrefix(args[k], "-") && !strings.Contains(args[k], "=") {
			// flag's boolean flags take no separate value
			return c.usageError(stderr, "unexpected argument %q (a switch takes its value after an equals sign: %s=%s)", pos[0], args[k], pos[0]), false
		}
		return c.usageError(stderr, "unexpected argument %q", pos[0]), false
	}
	return rc, ok
}

// usageError prints "NAME: message" and the synopsis to stderr and returns
// the exit status of a usage error, 2.
func (c *cli) usageError(stderr io.Writer, format string, a ...any) int {
	fmt.Fprintf(stderr, "%s: %s\nUsage: %s\nRun '%s -h' for the flags.\n", c.Name(), unprefixed(fmt.Sprintf(format, a...)), c.synopsis, c.Name())
	return 2
}

// fail prints "NAME: message" to stderr, one line, and returns the exit
// status of a runtime failure, 1.
func (c *cli) fail(stderr io.Writer, format string, a ...any) int {
	msg := strings.ReplaceAll(unprefixed(fmt.Sprintf(format, a...)), "\n", "; ")
	fmt.Fprintf(stderr, "%s: %s\n", c.Name(), msg)
	return 1
}

// enginePrefixes are the package prefixes of the library that does a
// command's work, whose errors the command's own prefix already places:
// the trainer's ("trainer: --lr -1: ...") under "dos train: ", "dos
// eval: ", "dos export: ". Used as a library, its errors keep them.
var enginePrefixes = []string{"trainer: "}

// unprefixed removes the engine's package prefixes (enginePrefixes) from
// msg where they begin it or one of its clauses (after ": " or "; "), so
// that a command prints one prefix: "dos train: --lr -1: ...", not "dos
// train: trainer: --lr -1: ...".
func unprefixed(msg string) string {
	for _, p := range enginePrefixes {
		for strings.HasPrefix(msg, p) {
			msg = msg[len(p):]
		}
		for _, sep := range []string{": ", "; "} {
			for strings.Contains(msg, sep+p) {
				msg = strings.ReplaceAll(msg, sep+p, sep)
			}
		}
	}
	return msg
}

// set reports whether the flag name was given on the command line.
func (c *cli) set(name string) bool {
	found := false
	c.Visit(func(f *flag.Flag) { found = found || f.Name == name })
	return found
}

// help prints the synopsis, what the command does and its flags (hidden
// aliases left out) to w.
func (c *cli) help(w io.Writer) {
	fmt.Fprintf(w, "Usage: %s\n\n", c.synopsis)
	if c.about != "" {
		fmt.Fprintf(w, "%s\n\n", strings.TrimRight(c.about, "\n"))
	}
	shown := false
	c.VisitAll(func(f *flag.Flag) { shown = shown || !c.hidden[f.Name] })
	if !shown {
		fmt.Fprintf(w, "(no flags)\n") // not a header over nothing
		return
	}
	fmt.Fprintf(w, "Flags (-flag and --flag are the same; flags may follow the arguments):\n")
	c.VisitAll(func(f *flag.Flag) {
		if c.hidden[f.Name] {
			return
		}
		name, usage := flag.UnquoteUsage(f)
		line := "  --" + f.Name
		if name != "" {
			line += " " + name
		}
		usage = strings.ReplaceAll(usage, "\n", "\n    \t")
		if def := f.DefValue; def != "" && def != "0" && def != "false" {
			usage += fmt.Sprintf(" (default %s)", def)
		}
		fmt.Fprintf(w, "%s\n    \t%s\n", line, usage)
	})
}

// sizeAccepts is what a size flag accepts, for the help.
const sizeAccepts = "a count: an integer, 1e9, 3.91e9, or with a decimal suffix K, M, B (or G), T: 834K, 50M, 7B"

// sizeSyntax is the syntax of a size: a decimal number, an optional
// exponent, an optional decimal suffix.
var sizeSyntax = regexp.MustCompile(`^([0-9][0-9_]*(\.[0-9]*)?|\.[0-9]+)([eE][+-]?[0-9]+)?([kKmMbBgGtT]?)$`)

// badUnderscore matches an underscore that does not stand between digits.
var badUnderscore = regexp.MustCompile(`(^|[^0-9])_|_([^0-9]|$)`)

// parseSize parses a count of parameters, elements or bytes, exactly (no
// rounding through float64): an integer (underscores allowed between
// digits), a decimal in e notation (1e9, 3.91e9), either with an optional
// decimal suffix K (1e3), M (1e6), B or G (1e9), T (1e12). The value must be
// a whole number from 0 to 2^63-1.
func parseSize(s string) (int64, error) {
	if strings.HasPrefix(s, "-") {
		return 0, fmt.Errorf("want a count >= 0")
	}
	m := sizeSyntax.FindStringSubmatch(s)
	if m == nil || badUnderscore.MatchString(s) {
		return 0, fmt.Errorf("want %s", sizeAccepts)
	}
	num := strings.ReplaceAll(s[:len(s)-len(m[4])], "_", "")
	r, ok := new(big.Rat).SetString(num)
	if !ok {
		return 0, fmt.Errorf("want %s", sizeAccepts)
	}
	exp := map[string]int64{"": 0, "k": 3, "m": 6, "b": 9, "g": 9, "t": 12}[strings.ToLower(m[4])]
	r.Mul(r, new(big.Rat).SetInt(new(big.Int).Exp(big.NewInt(10), big.NewInt(exp), nil)))
	if !r.IsInt() {
		return 0, fmt.Errorf("want a whole number")
	}
	if !r.Num().IsInt64() {
		return 0, fmt.Errorf("want at most 2^63-1")
	}
	return r.Num().Int64(), nil
}

// formatSize writes n as parseSize reads it, with the largest decimal
// suffix that keeps it exact: 100M, 1B, 834304.
func formatSize(n int64) string {
	for _, u := range []struct {
		suffix string
		v      int64
	}{{"T", 1e12}, {"B", 1e9}, {"M", 1e6}, {"K", 1e3}} {
		if n != 0 && n%u.v == 0 {
			return fmt.Sprintf("%d%s", n/u.v, u.suffix)
		}
	}
	return fmt.Sprint(n)
}

// size is the flag.Value of every flag that takes a count of parameters,
// elements or bytes (parseSize).
type size[T int | int64] struct{ p *T }

func (v size[T]) String() string {
	if v.p == nil {
		return "0"
	}
	return formatSize(int64(*v.p))
}

func (v size[T]) Set(s string) error {
	n, err := parseSize(s)
	if err != nil {
		return err
	}
	if int64(T(n)) != n {
		return fmt.Errorf("want at most %d", int64(^uint(0)>>1))
	}
	*v.p = T(n)
	return nil
}

// sizeVar defines a size flag on c that stores into p, its help saying
// what it accepts. usage names the value in back quotes as flag does.
func sizeVar[T int | int64](c *cli, p *T, name, usage string) {
	c.Var(size[T]{p}, name, usage+"; "+sizeAccepts)
}

// outputs are the output flags of dos bench, plan and calibrate: one
// spelling for each kind of output, the same in every command.
//
//	--json PATH   the results as JSON
//	--trace PATH  an update phase as Chrome trace-event JSON (Perfetto opens it)
//	--plot PATH   a figure, SVG, PNG or PDF by the extension
//
// --timeline, bench's and plan's old name of --plot, stays as a hidden
// alias: BENCHMARKS.md's recipes use it.
type outputs struct{ json, trace, plot *string }

// outputFlags defines on c the output flags whose description is not "":
// json what --json writes, trace what --trace writes, plot what --plot
// draws.
func outputFlags(c *cli, json, trace, plot string) *outputs {
	var o outputs
	empty := ""
	o.json, o.trace, o.plot = &empty, &empty, &empty
	if json != "" {
		o.json = c.String("json", "", "write "+json+" to `PATH` as JSON")
	}
	if trace != "" {
		o.trace = c.String("trace", "", "write "+trace+" to `PATH` as Chrome trace-event JSON (Perfetto opens it)")
	}
	if plot != "" {
		o.plot = c.String("plot", "", "draw "+plot+" to `PATH` (.svg, .png or .pdf)")
		if trace != "" {
			c.alias("timeline", "plot")
		}
	}
	return &o
}

// check refuses, before anything is measured, a --plot without a format's
// extension (a usage error, exit 2) and an output that cannot be written:
// its directory missing or not writable, or a directory (exit 1).
func (o *outputs) check(c *cli, stderr io.Writer) (rc int, ok bool) {
	if *o.plot != "" {
		if err := checkPlotExt(*o.plot); err != nil {
			return c.usageError(stderr, "--plot %v", err), false
		}
		if err := checkPlotPath(*o.plot); err != nil {
			return c.fail(stderr, "--plot %v", err), false
		}
	}
	for _, f := range []struct{ name, path string }{{"--json", *o.json}, {"--trace", *o.trace}} {
		if err := checkWritable(f.path); err != nil {
			return c.fail(stderr, "%s: %v", f.name, err), false
		}
	}
	return 0, true
}
