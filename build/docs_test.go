package build

import (
	"os"
	"path/filepath"
	"testing"

	"github.com/qemu-kubelet/qemu-kubelet/internal/doctest"
	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
)

// TestDocLinks: every relative link of the Markdown documentation (README,
// CONTRIBUTING, docs/, the chart's README, bench/, e2e/) names an existing
// file and, with #anchor, a heading of that file.
func TestDocLinks(t *testing.T) {
	root, err := testutil.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	var files []string
	for _, pattern := range []string{"README.md", "CONTRIBUTING.md", "docs/*.md", "charts/qemu-kubelet/README.md", "bench/*.md", "e2e/*.md"} {
		m, err := filepath.Glob(filepath.Join(root, pattern))
		if err != nil {
			t.Fatal(err)
		}
		files = append(files, m...)
	}
	if len(files) < 10 {
		t.Fatalf("found only %d Markdown files under %s", len(files), root)
	}
	docs := map[string]*doctest.Doc{}
	for _, f := range files {
		rel, _ := filepath.Rel(root, f)
		d, err := doctest.Read(rel)
		if err != nil {
			t.Fatal(err)
		}
		docs[filepath.ToSlash(rel)] = d
	}
	exists := func(rel string) bool {
		_, err := os.Stat(filepath.Join(root, rel))
		return err == nil
	}
	for _, e := range doctest.LinkErrors(docs, exists) {
		t.Error(e)
	}
}
