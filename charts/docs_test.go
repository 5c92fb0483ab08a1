package charts

import (
	"fmt"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	rbacv1 "k8s.io/api/rbac/v1"
	"k8s.io/apimachinery/pkg/apis/meta/v1/unstructured"
	"k8s.io/apimachinery/pkg/runtime"
	"sigs.k8s.io/yaml"

	"github.com/qemu-kubelet/qemu-kubelet/internal/doctest"
)

// onlySpans is a cell made of code spans alone (separated by commas).
var onlySpans = regexp.MustCompile("^`[^`]*`(, `[^`]*`)*$")

// TestValuesDefaultsDocumented: where a row of the values table of
// docs/install.md states the defaults as code spans alone (`a`, `b` for
// the values `x.a`, `.b` of the row), they are those of values.yaml.
func TestValuesDefaultsDocumented(t *testing.T) {
	doc, err := doctest.Read("docs/install.md")
	require.NoError(t, err)
	sec, err := doc.Section("Values")
	require.NoError(t, err)
	table, err := sec.Table("Value")
	require.NoError(t, err)
	b, err := os.ReadFile(filepath.Join(chartDir, "values.yaml"))
	require.NoError(t, err)
	var values map[string]any
	require.NoError(t, yaml.Unmarshal(b, &values))

	checked := 0
	for i, row := range table.Rows {
		var paths []string
		parent := ""
		for _, p := range doctest.CodeSpans(row[0]) {
			if strings.HasPrefix(p, ".") {
				p = parent + p
			} else if j := strings.LastIndex(p, "."); j >= 0 {
				parent = p[:j]
			}
			paths = append(paths, p)
		}
		if len(row) < 2 || !onlySpans.MatchString(row[1]) {
			continue // prose: a map or a default described in words
		}
		defs := doctest.CodeSpans(row[1])
		if len(defs) == 1 && len(paths) > 1 { // one default for all of them
			for len(defs) < len(paths) {
				defs = append(defs, defs[0])
			}
		}
		if len(paths) == 1 {
			if v, _ := lookup(values, paths[0]); !isScalar(v) && !isEmpty(v) {
				continue // a map or list shown in YAML form
			}
		}
		if len(defs) != len(paths) {
			t.Errorf("docs/install.md:%d: %d values but %d defaults in %q", table.Lines[i], len(paths), len(defs), row[1])
			continue
		}
		for j, p := range paths {
			v, ok := lookup(values, p)
			if !ok {
				t.Errorf("docs/install.md:%d: value %s is not in values.yaml", table.Lines[i], p)
				continue
			}
			if !isScalar(v) && !isEmpty(v) {
				continue
			}
			if !sameDefault(v, defs[j]) {
				t.Errorf("docs/install.md:%d: %s documented default `%s`, values.yaml has %#v", table.Lines[i], p, defs[j], v)
			}
			checked++
		}
	}
	require.Greater(t, checked, 25, "defaults checked in the values table of docs/install.md")
}

// lookup finds a dotted path in the values.
func lookup(values map[string]any, path string) (any, bool) {
	var cur any = values
	for _, k := range strings.Split(path, ".") {
		m, ok := cur.(map[string]any)
		if !ok {
			return nil, false
		}
		if cur, ok = m[k]; !ok {
			return nil, false
		}
	}
	return cur, true
}

// sameDefault compares a values.yaml value with a documented one: a
// string may be written bare or quoted, "" is the empty string, [] and {}
// empty lists and maps.
func sameDefault(v any, doc string) bool {
	switch x := v.(type) {
	case string:
		return doc == x || doc == fmt.Sprintf("%q", x)
	case []any:
		return len(x) == 0 && doc == "[]"
	case map[string]any:
		return len(x) == 0 && doc == "{}"
	case nil:
		return doc == "null"
	default:
		return fmt.Sprint(x) == doc
	}
}

func isScalar(v any) bool {
	switch v.(type) {
	case map[string]any, []any:
		return false
	}
	return true
}

func isEmpty(v any) bool {
	switch x := v.(type) {
	case map[string]any:
		return len(x) == 0
	case []any:
		return len(x) == 0
	}
	return false
}

// TestRBACDocumented: the RBAC table of docs/install.md is every rule the
// chart renders, no more and no less, with the default values and with
// each value its When column names (and each such boolean flipped from
// its default).
func TestRBACDocumented(t *testing.T) {
	table, err := doctest.TableIn("docs/install.md", "RBAC", "Subject")
	require.NoError(t, err)
	rows, errs := doctest.RBACRows("docs/install.md", table)
	require.Empty(t, errs)
	require.GreaterOrEqual(t, len(rows), 15, "rows of the RBAC table")
	b, err := os.ReadFile(filepath.Join(chartDir, "values.yaml"))
	require.NoError(t, err)
	var values map[string]any
	require.NoError(t, yaml.Unmarshal(b, &values))

	// The renders: the defaults, each row's When, each When value flipped.
	renders := [][]string{nil}
	seen := map[string]bool{"": true}
	add := func(sets []string) {
		slices.Sort(sets)
		if k := strings.Join(sets, ","); !seen[k] {
			seen[k] = true
			renders = append(renders, sets)
		}
	}
	for _, r := range rows {
		var sets []string
		for k, v := range r.When {
			sets = append(sets, k+"="+v)
			def, ok := lookup(values, k)
			require.True(t, ok, "docs/install.md:%d: When names %s, which values.yaml lacks", r.Line, k)
			if b, isBool := def.(bool); isBool {
				add([]string{fmt.Sprintf("%s=%t", k, !b)})
			}
		}
		add(sets)
	}
	for _, sets := range renders {
		value := func(k string) string {
			for _, s := range sets {
				if kk, v, _ := strings.Cut(s, "="); kk == k {
					return v
				}
			}
			v, _ := lookup(values, k)
			return fmt.Sprint(v)
		}
		applies := func(when map[string]string) bool {
			for k, v := range when {
				if value(k) != v {
					return false
				}
			}
			return true
		}
		desc := "default values"
		if len(sets) > 0 {
			desc = "--set " + strings.Join(sets, ",")
		}
		grants := renderedGrants(t, objects(t, render(t, "", sets...)))
		require.NotEmpty(t, grants, desc)
		for _, e := range doctest.RBACErrors("docs/install.md", rows, applies, grants, desc) {
			t.Error(e)
		}
	}
}

// renderedGrants are the rules of the rendered Roles and ClusterRoles, by
// the component they are for.
func renderedGrants(t *testing.T, objs []unstructured.Unstructured) []doctest.Grant {
	t.Helper()
	subjects := map[string]string{"controller": "controller", "node-agent": "node agent"}
	var out []doctest.Grant
	for _, o := range objs {
		if o.GetKind() != "Role" && o.GetKind() != "ClusterRole" {
			continue
		}
		subject, ok := subjects[o.GetLabels()["app.kubernetes.io/component"]]
		require.True(t, ok, "%s %s: component label %q", o.GetKind(), o.GetName(), o.GetLabels()["app.kubernetes.io/component"])
		scope := "cluster"
		if o.GetKind() == "Role" {
			scope = o.GetNamespace()
			if scope == releaseNS {
				scope = "release namespace"
			}
		}
		var role rbacv1.ClusterRole
		require.NoError(t, runtime.DefaultUnstructuredConverter.FromUnstructured(o.Object, &role))
		for _, r := range role.Rules {
			for _, g := range r.APIGroups {
				for _, res := range r.Resources {
					for _, v := range r.Verbs {
						out = append(out, doctest.Grant{Subject: subject, Scope: scope, Group: g, Resource: res, Verb: v})
					}
				}
			}
		}
	}
	return out
}
