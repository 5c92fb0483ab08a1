package v1alpha1

import (
	"fmt"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"sigs.k8s.io/yaml"

	"github.com/qemu-kubelet/qemu-kubelet/internal/doctest"
	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
)

// TestFieldsTableDocumented: the Fields table of docs/exporterset.md has a
// row for every field of the generated CRD's spec, and where the CRD
// defaults a field (kubebuilder markers), the row's default is that value.
func TestFieldsTableDocumented(t *testing.T) {
	root, err := testutil.RepoRoot()
	if err != nil {
		t.Fatal(err)
	}
	b, err := os.ReadFile(filepath.Join(root, "config", "crd", "qemu-kubelet.io_exportersets.yaml"))
	if err != nil {
		t.Fatal(err)
	}
	var crd struct {
		Spec struct {
			Versions []struct {
				Schema struct {
					OpenAPIV3Schema struct {
						Properties map[string]struct {
							Properties map[string]map[string]any `json:"properties"`
						} `json:"properties"`
					} `json:"openAPIV3Schema"`
				} `json:"schema"`
			} `json:"versions"`
		} `json:"spec"`
	}
	if err := yaml.Unmarshal(b, &crd); err != nil || len(crd.Spec.Versions) == 0 {
		t.Fatalf("CRD: %v", err)
	}
	fields := crd.Spec.Versions[0].Schema.OpenAPIV3Schema.Properties["spec"].Properties
	if len(fields) < 10 {
		t.Fatalf("CRD spec has only %d fields", len(fields))
	}
	doc, err := doctest.Read("docs/exporterset.md")
	if err != nil {
		t.Fatal(err)
	}
	sec, err := doc.Section("Fields")
	if err != nil {
		t.Fatal(err)
	}
	table, err := sec.Table("field")
	if err != nil {
		t.Fatal(err)
	}
	rows := map[string]int{}
	for i, row := range table.Rows {
		spans := doctest.CodeSpans(row[0])
		if len(spans) != 1 || !strings.HasPrefix(spans[0], "spec.") {
			t.Errorf("docs/exporterset.md:%d: want one `spec.<field>` in %q", table.Lines[i], row[0])
			continue
		}
		name := strings.TrimPrefix(spans[0], "spec.")
		rows[name] = i
		f, ok := fields[name]
		if !ok {
			t.Errorf("docs/exporterset.md:%d: spec.%s is not a field of the ExporterSet CRD", table.Lines[i], name)
			continue
		}
		def, ok := f["default"]
		if !ok {
			continue
		}
		documented := strings.TrimSpace(row[1])
		if s := doctest.CodeSpans(row[1]); len(s) > 0 {
			documented = s[0]
		}
		if want := fmt.Sprint(def); documented != want {
			t.Errorf("docs/exporterset.md:%d: spec.%s documented default %q, the CRD's is %q", table.Lines[i], name, documented, want)
		}
	}
	for name := range fields {
		if _, ok := rows[name]; !ok {
			t.Errorf("docs/exporterset.md: spec.%s of the CRD has no row in the Fields table", name)
		}
	}
}
