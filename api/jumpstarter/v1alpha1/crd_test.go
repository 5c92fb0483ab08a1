package v1alpha1_test

import (
	"fmt"
	"os"
	"path/filepath"
	"reflect"
	"regexp"
	"slices"
	"strings"
	"testing"

	"github.com/stretchr/testify/assert"
	"github.com/stretchr/testify/require"
	apiextv1 "k8s.io/apiextensions-apiserver/pkg/apis/apiextensions/v1"
	"sigs.k8s.io/yaml"

	"github.com/qemu-kubelet/qemu-kubelet/internal/testutil"
)

// TestGeneratedCRDsAreASubsetOfUpstreams holds the tests' Jumpstarter CRDs
// (config/jumpstarter/crd and config/virtualtarget/crd, generated from this
// package and api/virtualtarget/v1alpha1) against upstream's when they are
// beside the repository: same names, scope, version and subresources
// (status, and the scale subresource's paths); every property the project
// has exists upstream with the same type, format, enum, default, limits
// and list/map semantics; the same required fields (an upstream-required
// field the project lacks would make upstream refuse what the tests
// accept); every validation rule the project has is upstream's, and every
// upstream rule on the project's fields is the project's. Descriptions and
// printer columns may differ.
func TestGeneratedCRDsAreASubsetOfUpstreams(t *testing.T) {
	root := testutil.MustRepoRoot(t)
	up, ok, err := testutil.UpstreamJumpstarterCRDs(root)
	require.NoError(t, err)
	if !ok {
		t.Skip("upstream Jumpstarter CRDs not beside the repository ($QK_JUMPSTARTER_CRDS unset, none beside the repository)")
	}
	for _, g := range []struct {
		dir  string
		want []string
	}{
		{testutil.JumpstarterCRDs(root), []string{"jumpstarter.dev_exporters.yaml", "jumpstarter.dev_leases.yaml"}},
		{testutil.VirtualTargetCRDs(root), []string{"virtualtarget.jumpstarter.dev_exportersets.yaml", "virtualtarget.jumpstarter.dev_virtualtargetclasses.yaml"}},
	} {
		files, err := filepath.Glob(filepath.Join(g.dir, "*.yaml"))
		require.NoError(t, err)
		var names []string
		for _, f := range files {
			names = append(names, filepath.Base(f))
		}
		require.ElementsMatch(t, g.want, names, "the tests' CRDs in %s (hack/gen-crds.sh)", g.dir)
		for _, f := range files {
			t.Run(filepath.Base(f), func(t *testing.T) {
				upstream := filepath.Join(up, filepath.Base(f))
				if _, err := os.Stat(upstream); err != nil {
					t.Fatalf("upstream's CRDs in %s lack %s (upstream older than b1f2bb41?): %v", up, filepath.Base(f), err)
				}
				ours := readCRD(t, f)
				theirs := readCRD(t, upstream)
				for _, p := range crdSubsetProblems(ours, theirs) {
					t.Error(p)
				}
			})
		}
	}
}

// TestCRDSubsetProblems: the comparison finds each kind of drift.
func TestCRDSubsetProblems(t *testing.T) {
	root := testutil.MustRepoRoot(t)
	base := readCRD(t, filepath.Join(testutil.JumpstarterCRDs(root), "jumpstarter.dev_leases.yaml"))
	require.Empty(t, crdSubsetProblems(base, base.DeepCopy()), "a CRD is a subset of itself")
	spec := func(c *apiextv1.CustomResourceDefinition) *apiextv1.JSONSchemaProps {
		s := c.Spec.Versions[0].Schema.OpenAPIV3Schema.Properties["spec"]
		return &s
	}
	setSpec := func(c *apiextv1.CustomResourceDefinition, s *apiextv1.JSONSchemaProps) {
		c.Spec.Versions[0].Schema.OpenAPIV3Schema.Properties["spec"] = *s
	}
	for name, tc := range map[string]struct {
		ours, theirs func(*apiextv1.CustomResourceDefinition)
		want         string
	}{
		"field upstream lacks (pruned there)": {ours: func(c *apiextv1.CustomResourceDefinition) {
			s := spec(c)
			s.Properties["relase"] = apiextv1.JSONSchemaProps{Type: "boolean"}
			setSpec(c, s)
		}, want: "spec.relase: not in upstream's schema"},
		"type differs": {ours: func(c *apiextv1.CustomResourceDefinition) {
			s := spec(c)
			p := s.Properties["duration"]
			p.Type = "integer"
			s.Properties["duration"] = p
			setSpec(c, s)
		}, want: "spec.duration: type"},
		"upstream requires a field we lack": {theirs: func(c *apiextv1.CustomResourceDefinition) {
			s := spec(c)
			s.Properties["priority"] = apiextv1.JSONSchemaProps{Type: "integer"}
			s.Required = append(s.Required, "priority")
			setSpec(c, s)
		}, want: "spec: required"},
		"upstream rule on our fields missing": {theirs: func(c *apiextv1.CustomResourceDefinition) {
			s := spec(c)
			s.XValidations = append(s.XValidations, apiextv1.ValidationRule{Rule: "self.release == false || has(self.duration)"})
			setSpec(c, s)
		}, want: "upstream's rule"},
		"upstream rule on a field we lack is fine": {theirs: func(c *apiextv1.CustomResourceDefinition) {
			s := spec(c)
			s.Properties["tags"] = apiextv1.JSONSchemaProps{Type: "object"}
			s.XValidations = append(s.XValidations, apiextv1.ValidationRule{Rule: "!has(oldSelf.tags) || self.tags == oldSelf.tags"})
			setSpec(c, s)
		}},
		"no status subresource upstream": {theirs: func(c *apiextv1.CustomResourceDefinition) {
			c.Spec.Versions[0].Subresources = nil
		}, want: "subresources"},
		"default differs": {theirs: func(c *apiextv1.CustomResourceDefinition) {
			s := spec(c)
			p := s.Properties["selector"]
			p.Default = nil
			s.Properties["selector"] = p
			setSpec(c, s)
		}, want: "spec.selector: default"},
	} {
		t.Run(name, func(t *testing.T) {
			ours, theirs := base.DeepCopy(), base.DeepCopy()
			if tc.ours != nil {
				tc.ours(ours)
			}
			if tc.theirs != nil {
				tc.theirs(theirs)
			}
			got := strings.Join(crdSubsetProblems(ours, theirs), "\n")
			if tc.want == "" {
				assert.Empty(t, got)
			} else {
				assert.Contains(t, got, tc.want)
			}
		})
	}
}

func readCRD(t *testing.T, path string) *apiextv1.CustomResourceDefinition {
	t.Helper()
	b, err := os.ReadFile(path)
	require.NoError(t, err)
	var c apiextv1.CustomResourceDefinition
	require.NoError(t, yaml.UnmarshalStrict(b, &c), path)
	return &c
}

// crdSubsetProblems lists how ours fails to be a faithful subset of theirs.
func crdSubsetProblems(ours, theirs *apiextv1.CustomResourceDefinition) []string {
	var p []string
	if ours.Name != theirs.Name || ours.Spec.Group != theirs.Spec.Group || ours.Spec.Scope != theirs.Spec.Scope ||
		!reflect.DeepEqual(ours.Spec.Names, theirs.Spec.Names) {
		p = append(p, fmt.Sprintf("names/group/scope: ours %s %s %s %+v, upstream's %s %s %s %+v", ours.Name, ours.Spec.Group, ours.Spec.Scope, ours.Spec.Names,
			theirs.Name, theirs.Spec.Group, theirs.Spec.Scope, theirs.Spec.Names))
	}
	if len(ours.Spec.Versions) != 1 || len(theirs.Spec.Versions) != 1 {
		return append(p, fmt.Sprintf("versions: want one each, ours %d, upstream's %d", len(ours.Spec.Versions), len(theirs.Spec.Versions)))
	}
	ov, tv := ours.Spec.Versions[0], theirs.Spec.Versions[0]
	if ov.Name != tv.Name || ov.Served != tv.Served || ov.Storage != tv.Storage {
		p = append(p, fmt.Sprintf("version: ours %s served=%t storage=%t, upstream's %s served=%t storage=%t", ov.Name, ov.Served, ov.Storage, tv.Name, tv.Served, tv.Storage))
	}
	if !reflect.DeepEqual(ov.Subresources, tv.Subresources) {
		p = append(p, fmt.Sprintf("subresources: ours %+v, upstream's %+v", ov.Subresources, tv.Subresources))
	}
	return append(p, schemaSubsetProblems("", ov.Schema.OpenAPIV3Schema, tv.Schema.OpenAPIV3Schema)...)
}

var ruleField = regexp.MustCompile(`\b(?:self|oldSelf)\.([A-Za-z_][A-Za-z0-9_]*)`)

func schemaSubsetProblems(path string, ours, theirs *apiextv1.JSONSchemaProps) []string {
	if ours == nil && theirs == nil {
		return nil
	}
	at := strings.TrimPrefix(path, ".")
	if at == "" {
		at = "(root)"
	}
	if ours == nil || theirs == nil {
		return []string{fmt.Sprintf("%s: ours %v, upstream's %v", at, ours != nil, theirs != nil)}
	}
	var p []string
	same := func(what string, a, b any) {
		if !reflect.DeepEqual(a, b) {
			p = append(p, fmt.Sprintf("%s: %s: ours %v, upstream's %v", at, what, show(a), show(b)))
		}
	}
	same("type", ours.Type, theirs.Type)
	same("format", ours.Format, theirs.Format)
	same("enum", ours.Enum, theirs.Enum)
	same("default", ours.Default, theirs.Default)
	same("pattern", ours.Pattern, theirs.Pattern)
	same("limits", []any{ours.MaxLength, ours.MinLength, ours.Maximum, ours.Minimum, ours.MaxItems, ours.MinItems, ours.MaxProperties, ours.MinProperties},
		[]any{theirs.MaxLength, theirs.MinLength, theirs.Maximum, theirs.Minimum, theirs.MaxItems, theirs.MinItems, theirs.MaxProperties, theirs.MinProperties})
	same("x-kubernetes-preserve-unknown-fields/embedded/int-or-string", []any{ours.XPreserveUnknownFields, ours.XEmbeddedResource, ours.XIntOrString},
		[]any{theirs.XPreserveUnknownFields, theirs.XEmbeddedResource, theirs.XIntOrString})
	same("list/map type", []any{ours.XListType, ours.XListMapKeys, ours.XMapType}, []any{theirs.XListType, theirs.XListMapKeys, theirs.XMapType})
	same("required", sorted(ours.Required), sorted(theirs.Required))
	for _, r := range ours.XValidations {
		if !slices.ContainsFunc(theirs.XValidations, func(u apiextv1.ValidationRule) bool { return u.Rule == r.Rule }) {
			p = append(p, fmt.Sprintf("%s: rule %q is not upstream's", at, r.Rule))
		}
	}
	for _, u := range theirs.XValidations {
		if slices.ContainsFunc(ours.XValidations, func(r apiextv1.ValidationRule) bool { return r.Rule == u.Rule }) {
			continue
		}
		onOurs := true // a rule that reads a field we do not have cannot refuse what we write
		for _, m := range ruleField.FindAllStringSubmatch(u.Rule, -1) {
			if _, ok := ours.Properties[m[1]]; !ok {
				onOurs = false
			}
		}
		if onOurs {
			p = append(p, fmt.Sprintf("%s: upstream's rule %q on the project's fields is missing", at, u.Rule))
		}
	}
	for name := range ours.Properties {
		o, t := ours.Properties[name], theirs.Properties[name]
		if _, ok := theirs.Properties[name]; !ok {
			p = append(p, fmt.Sprintf("%s.%s: not in upstream's schema (upstream's API server would prune it)", at, name))
			continue
		}
		p = append(p, schemaSubsetProblems(path+"."+name, &o, &t)...)
	}
	if ours.Items != nil || theirs.Items != nil {
		var o, t *apiextv1.JSONSchemaProps
		if ours.Items != nil {
			o = ours.Items.Schema
		}
		if theirs.Items != nil {
			t = theirs.Items.Schema
		}
		p = append(p, schemaSubsetProblems(path+"[]", o, t)...)
	}
	if ours.AdditionalProperties != nil || theirs.AdditionalProperties != nil {
		var o, t *apiextv1.JSONSchemaProps
		if ours.AdditionalProperties != nil {
			o = ours.AdditionalProperties.Schema
		}
		if theirs.AdditionalProperties != nil {
			t = theirs.AdditionalProperties.Schema
		}
		p = append(p, schemaSubsetProblems(path+"{}", o, t)...)
	}
	slices.Sort(p)
	return p
}

func sorted(s []string) []string {
	s = slices.Clone(s)
	slices.Sort(s)
	return s
}

func show(v any) string {
	if j, ok := v.(*apiextv1.JSON); ok && j != nil {
		return string(j.Raw)
	}
	return fmt.Sprintf("%v", v)
}
