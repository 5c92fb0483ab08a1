package config

import (
	"fmt"
	"maps"
	"reflect"
	"slices"
	"strconv"
	"strings"

	"k8s.io/apimachinery/pkg/api/resource"
	"k8s.io/apimachinery/pkg/util/validation/field"
)

// Features is the features section of the file: what the node offers pods
// and kubelet API users. Every boolean field is a feature gate; its
// `default` tag is its default. Adding a gate is adding one field here (the
// rest: FeatureGates, validation, the node's annotation and reload, follows
// by reflection); a pod that needs it is held by one line in the provider
// (provider/features.go).
//
// Only this section is re-read at runtime (SIGHUP or a change of the file);
// docs/node-config.md#features.
type Features struct {
	// UEFI boots pods annotated qemu-kubelet.io/firmware=uefi through the
	// firmware of the firmware section. Off: such pods are held.
	UEFI *bool `json:"uefi,omitempty" default:"true"`
	// PortForward serves kubectl port-forward to guest TCP ports (the
	// kubelet API's /portForward). Off: refused with 403.
	PortForward *bool `json:"portForward,omitempty" default:"true"`
	// Attach serves kubectl attach to the serial console (/attach). Off:
	// refused with 403.
	Attach *bool `json:"attach,omitempty" default:"true"`
	// JumpstarterExporter runs the built-in Jumpstarter exporter of pods
	// naming an exporter Secret. Off: such pods are held.
	JumpstarterExporter *bool `json:"jumpstarterExporter,omitempty" default:"true"`
	// ConsoleLogSize bounds the console output kept per VM (console.log
	// plus its rotated half; quantity, default 8Mi, at least 64Ki). Applies
	// to VMs started after it is set.
	ConsoleLogSize QuantityString `json:"consoleLogSize,omitempty"`
}

// Feature gate names (the json names of the Features fields).
const (
	FeatureUEFI                = "uefi"
	FeaturePortForward         = "portForward"
	FeatureAttach              = "attach"
	FeatureJumpstarterExporter = "jumpstarterExporter"
)

// DefaultConsoleLogSize is qemu.DefaultConsoleCap (config does not import
// qemu); MinConsoleLogSize is the least qemu accepts.
const (
	DefaultConsoleLogSize QuantityString = "8Mi"
	MinConsoleLogSize                    = 64 << 10
)

// FeatureGate is one boolean field of Features.
type FeatureGate struct {
	// Name as written in the file.
	Name    string
	Default bool
	index   int
}

// FeatureGates lists the gates of Features, in field order.
var FeatureGates = featureGates()

func featureGates() []FeatureGate {
	var out []FeatureGate
	t := reflect.TypeFor[Features]()
	boolPtr := reflect.TypeFor[*bool]()
	for i := range t.NumField() {
		f := t.Field(i)
		if f.Type != boolPtr {
			continue
		}
		name, _, _ := strings.Cut(f.Tag.Get("json"), ",")
		def, err := strconv.ParseBool(f.Tag.Get("default"))
		if err != nil {
			panic(fmt.Sprintf("config.Features.%s: default tag: %v", f.Name, err))
		}
		out = append(out, FeatureGate{Name: name, Default: def, index: i})
	}
	return out
}

// FeatureConfig is the resolved features section: the state of every gate
// and the console log size. Treat it as immutable: a reload builds a new one
// and swaps it in whole.
type FeatureConfig struct {
	// Gates holds every gate of FeatureGates.
	Gates map[string]bool
	// ConsoleLogSize in bytes.
	ConsoleLogSize int64
}

// DefaultFeatures is the features section when the file has none.
func DefaultFeatures() *FeatureConfig {
	var f Features
	fc, errs := validateFeatures(f, nil)
	if len(errs) > 0 {
		panic(errs.ToAggregate())
	}
	return fc
}

// Enabled reports whether gate name is on (false for an unknown name).
func (f *FeatureConfig) Enabled(name string) bool {
	if f == nil {
		f = DefaultFeatures()
	}
	return f.Gates[name]
}

// String is the effective state in the form of --feature-gates, gates in
// name order, then the console log size: the node's annotation value.
func (f *FeatureConfig) String() string {
	parts := make([]string, 0, len(f.Gates)+1)
	for _, n := range slices.Sorted(maps.Keys(f.Gates)) {
		parts = append(parts, n+"="+strconv.FormatBool(f.Gates[n]))
	}
	parts = append(parts, "consoleLogSize="+resource.NewQuantity(f.ConsoleLogSize, resource.BinarySI).String())
	return strings.Join(parts, ",")
}

// FeatureChange is one difference between two FeatureConfigs.
type FeatureChange struct {
	Name     string
	Old, New string
}

// String renders "uefi: false -> true".
func (c FeatureChange) String() string { return c.Name + ": " + c.Old + " -> " + c.New }

// DiffFeatures lists what changes from old to next, gates in name order,
// then the console log size. Pure.
func DiffFeatures(old, next *FeatureConfig) []FeatureChange {
	var out []FeatureChange
	for _, n := range slices.Sorted(maps.Keys(next.Gates)) {
		if o, v := old.Gates[n], next.Gates[n]; o != v {
			out = append(out, FeatureChange{Name: n, Old: strconv.FormatBool(o), New: strconv.FormatBool(v)})
		}
	}
	if old.ConsoleLogSize != next.ConsoleLogSize {
		q := func(b int64) string { return resource.NewQuantity(b, resource.BinarySI).String() }
		out = append(out, FeatureChange{Name: "consoleLogSize", Old: q(old.ConsoleLogSize), New: q(next.ConsoleLogSize)})
	}
	return out
}

func defaultFeatures(f *Features) {
	v := reflect.ValueOf(f).Elem()
	for _, g := range FeatureGates {
		if fv := v.Field(g.index); fv.IsNil() {
			b := g.Default
			fv.Set(reflect.ValueOf(&b))
		}
	}
	if f.ConsoleLogSize == "" {
		f.ConsoleLogSize = DefaultConsoleLogSize
	}
}

// validateFeatures defaults a copy of f and resolves it.
func validateFeatures(f Features, errs field.ErrorList) (*FeatureConfig, field.ErrorList) {
	defaultFeatures(&f)
	out := &FeatureConfig{Gates: map[string]bool{}}
	v := reflect.ValueOf(f)
	for _, g := range FeatureGates {
		out.Gates[g.Name] = v.Field(g.index).Elem().Bool()
	}
	p := field.NewPath("features", "consoleLogSize")
	q, err := resource.ParseQuantity(string(f.ConsoleLogSize))
	switch {
	case err != nil:
		errs = append(errs, field.Invalid(p, string(f.ConsoleLogSize), "must be a quantity such as 8Mi"))
	case q.Value() < MinConsoleLogSize:
		errs = append(errs, field.Invalid(p, string(f.ConsoleLogSize), "must be at least 64Ki"))
	default:
		out.ConsoleLogSize = q.Value()
	}
	return out, errs
}

// ReloadPlan is what re-reading the configuration file changes in a running
// agent.
type ReloadPlan struct {
	// Features to apply (the new file's, or those in force when no feature
	// changed: two reloads of one file, by its change and by SIGHUP, leave
	// the same value in force); Changes lists how they differ from those in
	// force.
	Features *FeatureConfig
	Changes  []FeatureChange
	// RestartRequired names the top-level fields of the file that differ
	// from the ones the agent started with: they take effect only after a
	// restart and are not applied (not even in part).
	RestartRequired []string
}

// reloadable are the top-level fields a reload applies.
var reloadable = map[string]bool{"features": true}

// PlanReload compares the configuration the agent started with (started),
// the features in force (current) and the re-read file (next, resolved):
// only the features section is applied at runtime; every other field that
// differs from started is reported as needing a restart. Pure.
func PlanReload(started *Node, current *FeatureConfig, next *Node) ReloadPlan {
	plan := ReloadPlan{Features: next.Features, Changes: DiffFeatures(current, next.Features)}
	if len(plan.Changes) == 0 {
		plan.Features = current // nothing changed: the features in force stay, the same value
	}
	if started.File == nil || next.File == nil {
		return plan
	}
	a, b := reflect.ValueOf(*started.File), reflect.ValueOf(*next.File)
	t := a.Type()
	for i := range t.NumField() {
		name, _, _ := strings.Cut(t.Field(i).Tag.Get("json"), ",")
		if reloadable[name] || name == "apiVersion" || name == "kind" {
			continue
		}
		if !reflect.DeepEqual(a.Field(i).Interface(), b.Field(i).Interface()) {
			plan.RestartRequired = append(plan.RestartRequired, name)
		}
	}
	return plan
}
