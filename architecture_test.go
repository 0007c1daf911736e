package dos

import (
	"bufio"
	"go/build"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"testing"
)

const module = "github.com/deepstates/dos"

// archRow is one package of ARCHITECTURE.md's map.
type archRow struct {
	layer    int
	allowed  []string // module-relative; nil with "any package below"
	anyBelow bool
}

// readArchitecture parses the package map of ARCHITECTURE.md.
func readArchitecture(t *testing.T) map[string]archRow {
	t.Helper()
	f, err := os.Open("ARCHITECTURE.md")
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	rows := map[string]archRow{}
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		cells := strings.Split(sc.Text(), "|")
		if len(cells) != 6 {
			continue
		}
		layer, err := strconv.Atoi(strings.TrimSpace(cells[1]))
		if err != nil {
			continue // the header or the separator
		}
		pkg := strings.Trim(strings.TrimSpace(cells[2]), "`")
		if i := strings.Index(pkg, "` (`"); i >= 0 {
			pkg = pkg[:i]
		}
		row := archRow{layer: layer}
		switch may := strings.TrimSpace(cells[4]); may {
		case "—":
		case "any package below":
			row.anyBelow = true
		default:
			for _, p := range strings.Split(may, ",") {
				row.allowed = append(row.allowed, strings.Trim(strings.TrimSpace(p), "`"))
			}
		}
		if _, dup := rows[pkg]; dup {
			t.Errorf("ARCHITECTURE.md lists %s twice", pkg)
		}
		rows[pkg] = row
	}
	if len(rows) == 0 {
		t.Fatal("ARCHITECTURE.md has no package map")
	}
	return rows
}

// TestArchitecture: the package map of ARCHITECTURE.md matches the
// imports of every package of the module, and every arrow points down.
func TestArchitecture(t *testing.T) {
	rows := readArchitecture(t)
	seen := map[string]bool{}
	err := filepath.WalkDir(".", func(path string, d os.DirEntry, err error) error {
		if err != nil {
			return err
		}
		if !d.IsDir() {
			return nil
		}
		name := d.Name()
		if path != "." && (strings.HasPrefix(name, ".") || strings.HasPrefix(name, "_") || name == "testdata" || name == "bin") {
			return filepath.SkipDir
		}
		p, err := build.ImportDir(path, 0)
		if err != nil {
			if _, ok := err.(*build.NoGoError); ok {
				return nil
			}
			return err
		}
		rel := filepath.ToSlash(path)
		seen[rel] = true
		row, ok := rows[rel]
		if !ok {
			t.Errorf("package %s is not in ARCHITECTURE.md's map", rel)
			return nil
		}
		for _, imp := range p.Imports {
			dep, ok := strings.CutPrefix(imp, module+"/")
			if imp == module {
				dep, ok = ".", true
			}
			if !ok {
				continue
			}
			drow, ok := rows[dep]
			switch {
			case !ok:
				t.Errorf("%s imports %s, which is not in the map", rel, dep)
			case drow.layer >= row.layer:
				t.Errorf("%s (layer %d) imports %s (layer %d): an arrow that does not point down", rel, row.layer, dep, drow.layer)
			case !row.anyBelow && !slices.Contains(row.allowed, dep):
				t.Errorf("%s imports %s; ARCHITECTURE.md allows %v", rel, dep, row.allowed)
			}
		}
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	for pkg := range rows {
		if !seen[pkg] {
			t.Errorf("ARCHITECTURE.md lists %s, which does not exist", pkg)
		}
	}
	for pkg, row := range rows {
		for _, dep := range row.allowed {
			if d, ok := rows[dep]; !ok || d.layer >= row.layer {
				t.Errorf("ARCHITECTURE.md lets %s (layer %d) import %s (layer %d)", pkg, row.layer, dep, d.layer)
			}
		}
	}
}
