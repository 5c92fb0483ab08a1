package doctest

import (
	"testing"

	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
)

// TestDocsGoSymbols: every Go symbol the user docs name as `pkg.Symbol`
// (or `pkg.Type.Member`) is declared by a package of that name in the
// module, as its source declares it now.
func TestDocsGoSymbols(t *testing.T) {
	root, err := testutil.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	pkgs, err := ReadSymbols(root)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []string{"provider", "telemetry", "controller", "qemu", "oci", "exporter"} {
		if len(pkgs[p]) == 0 {
			t.Fatalf("package %s: no symbols read under %s", p, root)
		}
	}
	docs, err := ReadAll(UserDocs...)
	if err != nil {
		t.Fatal(err)
	}
	refs := 0
	for _, d := range docs {
		refs += len(d.SymbolRefs(pkgs))
	}
	if refs < 30 {
		t.Fatalf("only %d pkg.Symbol references found in %d docs: is the reference pattern broken?", refs, len(docs))
	}
	for _, e := range SymbolErrors(docs, pkgs) {
		t.Error(e)
	}
}
