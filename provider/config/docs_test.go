package config

import (
	"encoding/json"
	"fmt"
	"reflect"
	"runtime"
	"strings"
	"testing"

	"github.com/stretchr/testify/require"
	"sigs.k8s.io/yaml"

	"github.com/qemu-kubelet/qemu-kubelet/internal/doctest"
)

// The reference of docs/node-config.md is checked against this package: its
// example "every field, with its default" must decode strictly, name every
// field of NodeConfiguration and state the defaults Default fills in; the
// guest-architecture example must name every GuestArchitecture field and
// state its defaults; the VM memory table's defaults must be Default's.

// docEnv is a host on which every firmware file exists, so the defaults
// are the first candidates the docs name.
var docEnv = Environment{Hostname: "host-a", HostIP: "10.0.0.5", FileExists: func(string) bool { return true }, HostArch: "amd64"}

// placeholder marks a value the docs cannot state (derived from the host).
const placeholder = "<derived>"

func nodeConfigDoc(t *testing.T) *doctest.Doc {
	t.Helper()
	doc, err := doctest.Read("docs/node-config.md")
	require.NoError(t, err)
	return doc
}

func sectionYAML(t *testing.T, doc *doctest.Doc, title string) string {
	t.Helper()
	sec, err := doc.Section(title)
	require.NoError(t, err)
	blocks := sec.CodeBlocks("yaml")
	require.NotEmpty(t, blocks, "docs/node-config.md, %q: no yaml block", title)
	return blocks[0]
}

// withoutPlaceholders drops the lines whose value is the placeholder (the
// field is still named in the raw text, which the coverage check reads).
func withoutPlaceholders(y string) string {
	var out []string
	for _, l := range strings.Split(y, "\n") {
		if v, _, _ := strings.Cut(l, "#"); strings.Contains(v, placeholder) {
			continue
		}
		out = append(out, l)
	}
	return strings.Join(out, "\n")
}

// missingFields lists the json fields of typ (recursing into structs) that
// the decoded YAML map m does not name.
func missingFields(typ reflect.Type, m map[string]any, path string) []string {
	var out []string
	for i := 0; i < typ.NumField(); i++ {
		f := typ.Field(i)
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		if name == "" || name == "-" {
			continue
		}
		v, ok := m[name]
		if !ok {
			out = append(out, path+name)
			continue
		}
		ft := f.Type
		for ft.Kind() == reflect.Pointer {
			ft = ft.Elem()
		}
		if sub, isMap := v.(map[string]any); ft.Kind() == reflect.Struct && isMap {
			out = append(out, missingFields(ft, sub, path+name+".")...)
		}
	}
	return out
}

// normalized is v as JSON data with zero values ("", 0, false, empty lists
// and maps, null) dropped, so that a field the docs state as 0 and one
// Default leaves absent compare equal.
func normalized(t *testing.T, v any) any {
	t.Helper()
	b, err := json.Marshal(v)
	require.NoError(t, err)
	var out any
	require.NoError(t, json.Unmarshal(b, &out))
	return dropZero(out)
}

func dropZero(v any) any {
	switch x := v.(type) {
	case map[string]any:
		for k, e := range x {
			if e = dropZero(e); e == nil {
				delete(x, k)
			} else {
				x[k] = e
			}
		}
		if len(x) == 0 {
			return nil
		}
		return x
	case []any:
		for i := range x {
			x[i] = dropZero(x[i])
		}
		if len(x) == 0 {
			return nil
		}
		return x
	case string:
		if x == "" {
			return nil
		}
	case float64:
		if x == 0 {
			return nil
		}
	case bool:
		if !x {
			return nil
		}
	}
	return v
}

// TestExampleDocumentsEveryField: the example names every field of the file.
func TestExampleDocumentsEveryField(t *testing.T) {
	raw := sectionYAML(t, nodeConfigDoc(t), "Example (every field, with its default)")
	var m map[string]any
	require.NoError(t, yaml.Unmarshal([]byte(raw), &m), "the example is YAML")
	for _, f := range missingFields(reflect.TypeOf(NodeConfiguration{}), m, "") {
		t.Errorf("docs/node-config.md: field %s of NodeConfiguration is not in the example (every field, with its default)", f)
	}
	_, err := Decode([]byte(withoutPlaceholders(raw)))
	require.NoError(t, err, "the example decodes strictly (no unknown or misspelt field)")
}

// TestExampleStatesTheDefaults: the example, defaulted, is what Default
// makes of an empty file: every value it states is the default.
func TestExampleStatesTheDefaults(t *testing.T) {
	raw := sectionYAML(t, nodeConfigDoc(t), "Example (every field, with its default)")
	ex, err := Decode([]byte(withoutPlaceholders(raw)))
	require.NoError(t, err)
	require.NotEmpty(t, ex.Images.Registries, "the example shows a registry entry")
	ex.Images.Registries = nil // an example entry, not a default
	if runtime.GOARCH != "amd64" {
		ex.QEMUBinary = "" // the docs state the x86-64 host's; Default picks this host's
	}
	Default(ex, docEnv)
	def := &NodeConfiguration{APIVersion: APIVersion, Kind: Kind}
	Default(def, docEnv)
	got, want := normalized(t, ex), normalized(t, def)
	if !reflect.DeepEqual(got, want) {
		t.Errorf("docs/node-config.md: the example's values are not the defaults (Default of an empty file): %s", diffPaths(got, want, ""))
	}
}

// diffPaths names the JSON paths where a and b differ.
func diffPaths(a, b any, path string) string {
	am, aok := a.(map[string]any)
	bm, bok := b.(map[string]any)
	if !aok || !bok {
		if reflect.DeepEqual(a, b) {
			return ""
		}
		return fmt.Sprintf("%s: docs %v, code %v; ", path, a, b)
	}
	var out strings.Builder
	keys := map[string]bool{}
	for k := range am {
		keys[k] = true
	}
	for k := range bm {
		keys[k] = true
	}
	for k := range keys {
		out.WriteString(diffPaths(am[k], bm[k], path+"."+k))
	}
	return out.String()
}

// TestGuestArchitectureExample: the guestArchitectures example names every
// field of an entry and, but for capacityShare (derived from every node's
// maxVMs), states its defaults.
func TestGuestArchitectureExample(t *testing.T) {
	raw := sectionYAML(t, nodeConfigDoc(t), "Guest architectures")
	var m struct {
		GuestArchitectures []map[string]any `json:"guestArchitectures"`
	}
	require.NoError(t, yaml.Unmarshal([]byte(raw), &m))
	require.Len(t, m.GuestArchitectures, 1)
	for _, f := range missingFields(reflect.TypeOf(GuestArchitecture{}), m.GuestArchitectures[0], "guestArchitectures[0].") {
		t.Errorf("docs/node-config.md: field %s is not in the guest architectures example", f)
	}
	ex, err := Decode([]byte(header + raw))
	require.NoError(t, err, "the guest architectures example decodes strictly")
	ex.GuestArchitectures[0].CapacityShare = nil
	def := &NodeConfiguration{APIVersion: APIVersion, Kind: Kind, GuestArchitectures: []GuestArchitecture{{Arch: ex.GuestArchitectures[0].Arch}}}
	Default(ex, docEnv)
	Default(def, docEnv)
	got, want := normalized(t, ex.GuestArchitectures), normalized(t, def.GuestArchitectures)
	require.Equal(t, want, got, "docs/node-config.md: the guest architectures example's values are not the defaults (capacityShare aside)")
}

// TestVMMemoryTableDefaults: the Knob/Default table of "VM memory" names
// the vmMemory fields with their defaults.
func TestVMMemoryTableDefaults(t *testing.T) {
	sec, err := nodeConfigDoc(t).Section("VM memory")
	require.NoError(t, err)
	table, err := sec.Table("Knob")
	require.NoError(t, err)
	require.Equal(t, "Default", table.Header[1])
	def := &NodeConfiguration{}
	Default(def, docEnv)
	b, err := json.Marshal(def.VMMemory)
	require.NoError(t, err)
	var values map[string]any
	require.NoError(t, json.Unmarshal(b, &values))
	seen := map[string]bool{}
	for i, row := range table.Rows {
		knob := doctest.CodeSpans(row[0])
		defs := doctest.CodeSpans(row[1])
		require.Len(t, knob, 1, "line %d", table.Lines[i])
		require.NotEmpty(t, defs, "line %d: default cell %q", table.Lines[i], row[1])
		seen[knob[0]] = true
		v, ok := values[knob[0]]
		if !ok {
			v = 0 // absent after Default: the field's zero (e.g. ksmPagesToScan: the kernel's)
		}
		if got := fmt.Sprint(v); got != defs[0] {
			t.Errorf("docs/node-config.md:%d: vmMemory.%s documented default `%s`, Default gives %s", table.Lines[i], knob[0], defs[0], got)
		}
	}
	for _, f := range missingFields(reflect.TypeOf(VMMemory{}), map[string]any{}, "") {
		if !seen[f] {
			t.Errorf("docs/node-config.md: vmMemory.%s has no row in the VM memory table", f)
		}
	}
}
