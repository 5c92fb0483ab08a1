package v1alpha1_test

import (
	"fmt"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	apiextv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"sigs.k8s.io/yaml"

	v1 "github.com/qemu-kubelet/qemu-kubelet/api/v1alpha1"
	vt "github.com/qemu-kubelet/qemu-kubelet/api/virtualtarget/v1alpha1"
	"github.com/qemu-kubelet/qemu-kubelet/internal/doctest"
	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
)

// TestCoexistenceNamesDocumented holds the naming table of
// docs/exporterset.md ("Beside Jumpstarter's own ExporterSet API") against
// the CRDs of both groups: each full name is a CRD of the group and kind
// the row means, each short name is declared by that CRD alone (no CRD of
// the other group declares it as any of its names, so it cannot resolve
// elsewhere), and the table covers both kinds of both groups.
func TestCoexistenceNamesDocumented(t *testing.T) {
	root := testutil.MustRepoRoot(t)
	var crds []apiextv1.CustomResourceDefinition
	for _, dir := range []string{filepath.Join(root, "config", "crd"), testutil.VirtualTargetCRDs(root)} {
		files, err := filepath.Glob(filepath.Join(dir, "*.yaml"))
		require.NoError(t, err)
		for _, f := range files {
			b, err := os.ReadFile(f)
			require.NoError(t, err)
			var c apiextv1.CustomResourceDefinition
			require.NoError(t, yaml.Unmarshal(b, &c), f)
			crds = append(crds, c)
		}
	}
	names := func(c apiextv1.CustomResourceDefinition) []string {
		n := c.Spec.Names
		return append([]string{n.Plural, n.Singular, strings.ToLower(n.Kind)}, n.ShortNames...)
	}

	tab, err := doctest.TableIn("docs/exporterset.md", "Beside Jumpstarter's own ExporterSet API", "You mean")
	require.NoError(t, err)
	covered := map[string]bool{}
	for i, row := range tab.Rows {
		at := func(format string, args ...any) string {
			return fmt.Sprintf("docs/exporterset.md:%d: ", tab.Lines[i]) + fmt.Sprintf(format, args...)
		}
		require.Len(t, row, 2, at("two cells"))
		group, kind := v1.GroupVersion.Group, ""
		if strings.HasPrefix(row[0], "upstream's") {
			group = vt.GroupVersion.Group
		}
		switch {
		case strings.HasSuffix(row[0], " sets"):
			kind = "ExporterSet"
		case strings.HasSuffix(row[0], " classes"):
			kind = "VirtualTargetClass"
		default:
			t.Fatalf("%s", at("%q: neither sets nor classes", row[0]))
		}
		covered[group+"/"+kind] = true
		spans := doctest.CodeSpans(row[1])
		require.NotEmpty(t, spans, at("no names"))
		for _, s := range spans {
			k := slices.IndexFunc(crds, func(c apiextv1.CustomResourceDefinition) bool {
				return c.Spec.Group == group && c.Spec.Names.Kind == kind
			})
			require.GreaterOrEqual(t, k, 0, at("no CRD of %s %s", group, kind))
			mine := crds[k]
			if strings.Contains(s, ".") {
				assert.Equal(t, mine.Name, s, at("the full name of %s %s", group, kind))
				continue
			}
			assert.Contains(t, mine.Spec.Names.ShortNames, s, at("%q is not a short name of %s", s, mine.Name))
			for _, c := range crds {
				if c.Spec.Group != group {
					assert.NotContains(t, names(c), s, at("%q is also a name of %s: it would not mean %s alone", s, c.Name, mine.Name))
				}
			}
		}
	}
	assert.Len(t, covered, 4, "the table names both kinds of both groups")
}
